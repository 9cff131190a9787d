// tokenwire's jsctrl glue: the JavaScript side of JsController (our own implementation of the
// API declared in microsoft/aici controllers/jsctrl/samples/aici-types.d.ts).
//
// Host functions arrive as globals __tw_n_<name>; they are captured here and removed from the
// global object. Python enters only through __tw_call(name, argsJson) and reads JSON back.
(function () {
  "use strict";
  const G = globalThis;
  const N = {};
  for (const k of Object.getOwnPropertyNames(G)) {
    if (k.startsWith("__tw_n_")) {
      N[k.slice(7)] = G[k];
      delete G[k];
    }
  }
  const ERR = "\u0001ERR:";
  function host(name, ...args) {
    const r = N[name](...args);
    if (typeof r === "string" && r.startsWith(ERR)) throw new Error(r.slice(ERR.length));
    return r;
  }
  const VOCAB = host("vocab_size");
  const WORDS = (VOCAB + 31) >>> 5;

  // ---- sandbox: deterministic randomness (clones replay the same stream), no clock ------------
  let seed = host("seed") >>> 0 || 0x9e3779b9;
  Math.random = function () {
    seed ^= seed << 13; seed >>>= 0;
    seed ^= seed >>> 17;
    seed ^= seed << 5; seed >>>= 0;
    return seed / 4294967296;
  };
  const RealDate = Date;
  function SandboxDate(...a) {
    if (!new.target) return new RealDate(0).toString();
    return a.length ? new RealDate(...a) : new RealDate(0);
  }
  SandboxDate.prototype = RealDate.prototype;
  SandboxDate.now = () => 0;
  SandboxDate.UTC = RealDate.UTC;
  SandboxDate.parse = RealDate.parse;
  G.Date = SandboxDate;

  // ---- bytes -----------------------------------------------------------------------------------
  const HEX = "0123456789abcdef";
  function bufToHex(b) {
    let s = "";
    for (let i = 0; i < b.length; i++) s += HEX[b[i] >> 4] + HEX[b[i] & 15];
    return s;
  }
  function hexToBuf(h) {
    const b = new Uint8Array(h.length >> 1);
    for (let i = 0; i < b.length; i++) b[i] = parseInt(h.substr(2 * i, 2), 16);
    return b;
  }
  function toBytes(v) {
    if (v instanceof Uint8Array) return v;
    return stringToBuffer(String(v));
  }
  function stringToBuffer(s) { return hexToBuf(host("utf8_encode", JSON.stringify(String(s)))); }
  function bufferToString(b) { return JSON.parse(host("utf8_decode", bufToHex(b))); }
  function bufferRepr(b) { return host("buffer_repr", bufToHex(b)); }

  // ---- tokenizer -------------------------------------------------------------------------------
  function tokenize(text) {
    if (text instanceof Uint8Array) return JSON.parse(host("tokenize_bytes", bufToHex(text)));
    return JSON.parse(host("tokenize", JSON.stringify(String(text))));
  }
  function detokenize(tokens) { return hexToBuf(host("detokenize", JSON.stringify(Array.from(tokens)))); }
  function tokenRepr(t) { return host("tokens_repr", JSON.stringify([t])); }
  function tokensRepr(ts) { return host("tokens_repr", JSON.stringify(Array.from(ts))); }
  function eosToken() { return host("eos"); }

  // ---- variables (shared by the forks of a request) -------------------------------------------
  function getVar(name) {
    const h = host("get_var", String(name));
    return h === null ? null : hexToBuf(h);
  }
  function setVar(name, value) { host("set_var", String(name), bufToHex(toBytes(value)), false); }
  function appendVar(name, value) { host("set_var", String(name), bufToHex(toBytes(value)), true); }
  function getConfig(name) { return name === "fork" ? 1 : 0; }

  // ---- TokenSet: a bitset over the vocabulary, kept in JS (no host handles to leak) ------------
  // A mask computed by a host constraint stays on the host (`_lazy` = its id) until the program
  // looks at single bits; mid_process hands the id back, so the common path never copies it.
  class TokenSet {
    constructor() { this._w = new Uint32Array(WORDS); this._lazy = null; }
    get length() { return VOCAB; }
    _mat() {
      if (this._lazy !== null) {
        const id = this._lazy;
        this._lazy = null;
        this._orHex(host("mask_hex", id));
      }
      return this._w;
    }
    add(t) { const w = this._mat(); if (t >= 0 && t < VOCAB) w[t >>> 5] |= 1 << (t & 31); }
    delete(t) { const w = this._mat(); if (t >= 0 && t < VOCAB) w[t >>> 5] &= ~(1 << (t & 31)); }
    has(t) { const w = this._mat(); return t >= 0 && t < VOCAB && (w[t >>> 5] & (1 << (t & 31))) !== 0; }
    clear() { this._lazy = null; this._w.fill(0); }
    setAll(v) {
      this._lazy = null;
      this._w.fill(v ? 0xffffffff : 0);
      if (v && VOCAB & 31) this._w[WORDS - 1] = (1 << (VOCAB & 31)) - 1;
    }
    numSet() {
      if (this._lazy !== null) return host("mask_count", this._lazy);
      let n = 0;
      for (let i = 0; i < WORDS; i++) {
        let x = this._w[i];
        x -= (x >>> 1) & 0x55555555;
        x = (x & 0x33333333) + ((x >>> 2) & 0x33333333);
        n += (((x + (x >>> 4)) & 0x0f0f0f0f) * 0x01010101) >>> 24;
      }
      return n;
    }
    toString() { return `TokenSet(${this.numSet()}/${VOCAB})`; }
    _isEmpty() { return this._lazy === null && this._w.every((x) => x === 0); }
    _orMask(id) { if (this._isEmpty()) this._lazy = id; else this._orHex(host("mask_hex", id)); }
    _orHex(h) {
      // h: big-endian hex of each 32-bit word (8 chars per word), as the host writes masks
      const n = Math.min(WORDS, h.length >>> 3);
      for (let i = 0; i < n; i++) this._w[i] |= parseInt(h.substr(i << 3, 8), 16);
    }
    _hex() {
      if (this._lazy !== null) return "@" + this._lazy;
      let s = "";
      for (let i = 0; i < WORDS; i++) s += (this._w[i] >>> 0).toString(16).padStart(8, "0");
      return s;
    }
  }
  function allTokens() { const ts = new TokenSet(); ts.setAll(true); return ts; }

  // ---- constraints -----------------------------------------------------------------------------
  class Constraint {
    constructor() {}
    eosAllowed() { return true; }
    eosForced() { return false; }
    tokenAllowed(_t) { return true; }
    appendToken(_t) {}
    allowTokens(ts) { ts.setAll(true); }
  }
  class HostConstraint extends Constraint {
    constructor(h) { super(); this._h = h; }
    eosAllowed() { return host("c_eos_allowed", this._h); }
    eosForced() { return host("c_eos_forced", this._h); }
    tokenAllowed(t) { return host("c_token_allowed", this._h, t); }
    appendToken(t) { host("c_append", this._h, t); }
    allowTokens(ts) { ts._orMask(host("c_mask", this._h)); }
    _free() { host("c_free", this._h); }
  }
  function regexConstraint(pattern) {
    log(`regex constraint: ${JSON.stringify(pattern)}`);
    return new HostConstraint(host("c_regex", String(pattern)));
  }
  // AICI's cfgConstraint takes a yacc grammar; ours takes llguidance's Lark dialect.
  function cfgConstraint(grammar) { return new HostConstraint(host("c_lark", String(grammar))); }
  function substrConstraint(template, stopAt) {
    return new HostConstraint(host("c_substr", String(template), String(stopAt)));
  }
  class ChooseConstraint extends Constraint {
    constructor(options) {
      super();
      this.ptr = 0;
      this.options = options.map((o) => tokenize(o));
    }
    eosAllowed() { return this.options.some((o) => o.length === this.ptr); }
    eosForced() { return this.options.length === 1 && this.options[0].length === this.ptr; }
    tokenAllowed(t) { return this.options.some((o) => this.ptr < o.length && o[this.ptr] === t); }
    appendToken(t) {
      this.options = this.options.filter((o) => this.ptr < o.length && o[this.ptr] === t);
      this.ptr += 1;
    }
    allowTokens(ts) {
      for (const o of this.options) {
        if (this.ptr < o.length) ts.add(o[this.ptr]);
        else if (this.ptr === o.length) ts.add(eosToken());
      }
    }
  }

  // ---- logging ---------------------------------------------------------------------------------
  let logLevel = 1;
  function setLogLevel(level) { logLevel = level; }
  function inspectValue(v, depth) {
    if (v === null) return "null";
    if (v === undefined) return "undefined";
    if (typeof v === "object") {
      if (v instanceof RegExp) return v.toString();
      if (v instanceof Uint8Array) return bufferRepr(v);
      if (v instanceof TokenSet) return v.toString();
      if (Array.isArray(v)) {
        if (depth >= 2 && v.length) return "[...]";
        const more = v.length > 20 ? ", ...]" : "]";
        return "[" + v.slice(0, 20).map((x) => inspectValue(x, depth + 1)).join(", ") + more;
      }
      let keys = Object.keys(v);
      if (depth >= 2 && keys.length) return "{...}";
      const more = keys.length > 20 ? ", ...}" : "}";
      keys = keys.slice(0, 20);
      return "{" + keys.map((k) => `${k}: ${inspectValue(v[k], depth + 1)}`).join(", ") + more;
    }
    const s = String(v);
    return depth > 0 && typeof v === "string" && s.length > 200 ? s.slice(0, 200) + "..." : s;
  }
  function inspect(v) { return inspectValue(v, 0); }
  function log(...args) { host("log", args.map(inspect).join(" ")); }
  const console = { log, info: log, warn: log, error: log, debug: log, trace: log };

  class AssertionError extends Error {}
  function assert(cond, msg = "Assertion failed") { if (!cond) throw new AssertionError(msg); }
  function panic(e) { throw e instanceof Error ? e : new Error(String(e)); }

  // ---- callback results --------------------------------------------------------------------------
  class MidProcessResult {
    constructor() {
      this._n_skip_me = false; this._n_stop = false; this._n_logit_bias = null;
      this._n_backtrack = 0; this._n_ff_tokens = [];
    }
    static stop() { const r = new MidProcessResult(); r._n_stop = true; return r; }
    static bias(ts) { const r = new MidProcessResult(); r._n_logit_bias = ts; return r; }
    static splice(backtrack, tokens) {
      assert(backtrack >= 0 && Array.isArray(tokens));
      const r = new MidProcessResult(); r._n_backtrack = backtrack; r._n_ff_tokens = tokens; return r;
    }
    static skipMe() { const r = new MidProcessResult(); r._n_skip_me = true; return r; }
  }
  class PreProcessResult {
    constructor() { this._n_suspended = false; this._n_ff_tokens = []; this._n_num_forks = 1; }
    static continue_() { return new PreProcessResult(); }
    static suspend() { const r = new PreProcessResult(); r._n_suspended = true; return r; }
    static fork(n) { const r = new PreProcessResult(); r._n_num_forks = n; return r; }
    static ffTokens(toks) { const r = new PreProcessResult(); r._n_ff_tokens = toks; return r; }
  }
  class PostProcessResult {
    constructor(stop = false) { this._n_stop_seq = stop; }
    static continue_() { return new PostProcessResult(); }
    static stop() { return new PostProcessResult(true); }
    static fromTokens(tokens) { return new PostProcessResult(tokens.includes(eosToken())); }
  }

  // ---- the sequence: what the program waits on ----------------------------------------------------
  const S = { tokens: [], promptLen: 0, cur: null, parked: null, started: false, done: false,
              error: null, forkIndex: 0, prompt: null };

  function getTokens() { return S.tokens; }
  function getPromptLen() { return S.promptLen; }
  function selfSeqId() { return S.forkIndex; }

  class NextToken {
    constructor() { this.finished = false; this.currTokens = null; this.forkGroup = []; }
    run() {
      assert(!this._resolve, "NextToken.run() called twice");
      if (S.cur !== null) throw new Error("two pending generation steps (a missing `await`?)");
      S.cur = this;
      return new Promise((resolve) => { this._resolve = resolve; });
    }
    preProcess() { return PreProcessResult.continue_(); }
    midProcess() { return MidProcessResult.bias(allTokens()); }
    postProcess(_tokens) { return PostProcessResult.continue_(); }
    _pre_process() { this.currTokens = null; return this.preProcess(); }
    _mid_process() { return this.midProcess(); }
    _post_process(_backtrack, tokens) {
      this.currTokens = tokens;
      this.finished = tokens.includes(eosToken());
      return this.postProcess(tokens);
    }
  }
  class FixedTokens extends NextToken {
    constructor(text, following = null) {
      super();
      this.fixedTokens = tokenize(text);
      if (logLevel >= 1) log("FIXED", JSON.stringify(bufferToString(detokenize(this.fixedTokens))));
      this.following = following;
    }
    preProcess() {
      return this.following === null ? PreProcessResult.ffTokens(this.fixedTokens) : PreProcessResult.continue_();
    }
    midProcess() {
      let backtrack = 0;
      if (this.following !== null) {
        backtrack = S.tokens.length - this.following.ptr;
        assert(backtrack >= 0);
        if (logLevel >= 1) log("BACKTRACK", backtrack);
      }
      return MidProcessResult.splice(backtrack, this.fixedTokens);
    }
  }
  class StopToken extends NextToken {
    midProcess() { return MidProcessResult.stop(); }
    postProcess(_tokens) { this.finished = false; return PostProcessResult.stop(); }
  }
  class ConstrainedToken extends NextToken {
    constructor(mkConstraint) { super(); this.mkConstraint = mkConstraint; this._constraint = null; }
    midProcess() {
      if (this._constraint === null) this._constraint = this.mkConstraint();
      const bias = new TokenSet();
      this._constraint.allowTokens(bias);
      if (logLevel >= 2) log("ALLOW:", bias.toString());
      if (bias.numSet() === 0) {
        if (logLevel >= 1) log("Constraint doesn't allow any tokens; stopping");
        return MidProcessResult.stop();
      }
      return MidProcessResult.bias(bias);
    }
    postProcess(tokens) {
      const c = this._constraint;
      assert(!!c);
      tokens.forEach((t) => c.appendToken(t));
      if (c.eosForced()) this.finished = true;
      return PostProcessResult.continue_();
    }
  }
  class PreToken extends NextToken {
    midProcess() { return MidProcessResult.skipMe(); }
  }
  class Fork extends PreToken {
    constructor(n) { super(); this.numForks = n; }
    preProcess() { return PreProcessResult.fork(this.numForks); }
  }
  class WaitVars extends PreToken {
    constructor(vars) { super(); this.vars = vars; this.values = []; }
    preProcess() {
      const values = this.vars.map((v) => getVar(v));
      if (values.includes(null)) return PreProcessResult.suspend();
      this.values = values;
      return PreProcessResult.continue_();
    }
  }

  async function fixed(text) { await new FixedTokens(text).run(); }
  async function $(strings, ...values) {
    let text = "";
    strings.forEach((s, i) => { text += s; if (i < values.length) text += inspect(values[i]); });
    await fixed(text);
  }
  function forkSupported() { return true; }
  async function fork(numForks) {
    assert(Number.isInteger(numForks) && numForks >= 1, "fork(n) needs a positive integer");
    if (numForks === 1) return 0;
    await new Fork(numForks).run();
    return S.forkIndex;
  }
  async function waitVars(...vars) {
    const w = new WaitVars(vars);
    await w.run();
    return w.values;
  }
  function getPrompt() { return Promise.resolve(S.tokens.slice(0, S.promptLen)); }

  class Label {
    constructor() { this.ptr = S.tokens.length; }
    tokensSince() { return S.tokens.slice(this.ptr); }
    textSince() { return bufferToString(detokenize(this.tokensSince())); }
    async fixedAfter(text) { await new FixedTokens(text, this).run(); }
  }

  async function genTokens(options) {
    if (logLevel >= 1) log("GEN-OPT", options);
    const { regex, yacc, lark, substring, substringEnd = '"', options: choices, storeVar, stopAt,
            maxTokens = 20 } = options;
    const kinds = [regex, yacc, lark, substring, choices].filter((x) => x !== undefined);
    assert(kinds.length <= 1, "gen(): give at most one of regex, yacc, lark, substring, options");
    // built on first use, in mid_process (llguidance compiles the grammar; pre_process is ~1 ms)
    let constraint = null;
    const build = () => {
      if (regex !== undefined) return regexConstraint(typeof regex === "string" ? regex : regex.source);
      if (substring !== undefined) return substrConstraint(substring, substringEnd);
      if (yacc !== undefined) return cfgConstraint(yacc);
      if (lark !== undefined) return cfgConstraint(lark);
      if (choices !== undefined) return new ChooseConstraint(choices);
      return new Constraint();
    };
    const eos = eosToken();
    const res = [];
    const step = new ConstrainedToken(() => (constraint = build()));
    try {
      for (let i = 0; i < maxTokens; i++) {
        const tokens = await step.run();
        res.push(...tokens.filter((t) => t !== eos));
        if (logLevel >= 2) log("GEN-STEP:", tokens.map((t) => tokenRepr(t)).join(", "));
        if (stopAt !== undefined && bufferToString(detokenize(res)).includes(stopAt)) break;
        if (step.finished) break;
      }
    } finally {
      if (constraint instanceof HostConstraint) constraint._free();
    }
    if (storeVar !== undefined) setVar(storeVar, detokenize(res));
    if (logLevel >= 1) log("GEN", JSON.stringify(bufferToString(detokenize(res))));
    return res;
  }
  async function gen(options) { return bufferToString(detokenize(await genTokens(options))); }

  function checkVar(name, value) {
    const v = getVar(name);
    if (v === null) throw new AssertionError(`Variable ${name} is unset`);
    const s = bufferToString(v);
    if (s !== value) throw new AssertionError(`Variable ${name}: ${JSON.stringify(s)} != ${JSON.stringify(value)}`);
  }
  function checkVars(d) { for (const [k, v] of Object.entries(d)) checkVar(k, v); }

  function describeError(e) {
    if (e instanceof Error) return `${e.name}: ${e.message}\n${e.stack || ""}`.trim();
    return String(e);
  }
  function start(f) {
    if (S.started) throw new Error("start() called twice");
    S.started = true;
    let p;
    try { p = Promise.resolve(f()); } catch (e) { p = Promise.reject(e); }
    p.then(() => { S.done = true; if (logLevel >= 1) log("JsCtrl: done"); },
           (e) => { S.error = describeError(e); });
  }
  function test(f) { start(async () => { await f(); log("TEST OK"); }); }

  // ---- entry points called by JsController ----------------------------------------------------------
  function resolveCurrent(tokens) {
    const t = S.cur;
    S.cur = null;
    const resolve = t._resolve;
    t._resolve = undefined;
    resolve(tokens);
  }
  function requireCurrent(what) {
    if (S.cur === null) throw new Error(`${what}: the program is not waiting for a generation step`);
    return S.cur;
  }
  function preJson(r) {
    assert(r instanceof PreProcessResult, "preProcess() must return a PreProcessResult");
    return { suspend: !!r._n_suspended, ff: Array.from(r._n_ff_tokens), forks: r._n_num_forks | 0 };
  }
  const entries = {
    run_script(a) { (0, eval)(a.source); if (!S.started) throw new Error("the program never called start()"); return {}; },
    init_prompt(a) { S.tokens = a.prompt.slice(); S.promptLen = a.prompt.length; return {}; },
    pre() {
      if (S.done) return { suspend: false, ff: [], forks: 0 };
      return preJson(requireCurrent("pre_process")._pre_process());
    },
    reentry_pre() {
      // a PreToken finished inside mid_process: the next step's pre phase runs here
      const cur = requireCurrent("mid_process");
      const r = preJson(cur._pre_process());
      if (r.forks !== 1) throw new Error("fork() right after fork()/waitVars() is not supported");
      if (r.suspend) {
        // mid_process cannot suspend: emit one filler token (a space) and wait again after it
        S.parked = cur;
        S.cur = null;
        const f = new FixedTokens(" ");
        assert(f.fixedTokens.length === 1);
        S.cur = f;
      }
      return {};
    },
    mid() {
      if (S.done) return { stop: true };
      const r = requireCurrent("mid_process")._mid_process();
      assert(r instanceof MidProcessResult, "midProcess() must return a MidProcessResult");
      if (r._n_skip_me) return { skip: true };
      if (r._n_stop) return { stop: true };
      if (r._n_backtrack > 0 || r._n_ff_tokens.length > 0)
        return { backtrack: r._n_backtrack | 0, ff: Array.from(r._n_ff_tokens) };
      const ts = r._n_logit_bias;
      return { bias: ts instanceof TokenSet ? ts._hex() : null };
    },
    skip() { resolveCurrent([]); return {}; },
    post(a) {
      if (a.backtrack > 0) S.tokens.splice(S.tokens.length - a.backtrack, a.backtrack);
      S.tokens.push(...a.tokens);
      if (S.done) return { stop: true };
      const cur = requireCurrent("post_process");
      const r = cur._post_process(a.backtrack, a.tokens.slice());
      assert(r instanceof PostProcessResult, "postProcess() must return a PostProcessResult");
      if (S.parked !== null) { S.cur = S.parked; S.parked = null; } else resolveCurrent(a.tokens);
      return { stop: !!r._n_stop_seq };
    },
    fork(a) {
      const cur = requireCurrent("fork");
      assert(cur instanceof Fork, "fork index given while not forking");
      S.forkIndex = a.index;
      resolveCurrent([]);
      return {};
    },
    state() {
      return { done: S.done, error: S.error, waiting: S.cur !== null,
               fork: S.cur instanceof Fork ? S.cur.numForks : 0 };
    },
  };
  G.__tw_call = function (name, argsJson) {
    delete G.__tw_unlock; // lets the host functions run under the time limit (see controller.py)
    return JSON.stringify(entries[name](JSON.parse(argsJson)));
  };

  // ---- the public API: globals and the "aici" / "_aici" modules ---------------------------------------
  const native = { TokenSet, Constraint, tokenize, detokenize, tokenRepr, tokensRepr, selfSeqId, panic,
                   getVar, setVar, appendVar, getConfig, eosToken, stringToBuffer, bufferToString,
                   bufferRepr, regexConstraint, cfgConstraint, substrConstraint };
  const aici = { TokenSet, tokenize, detokenize, getVar, setVar, appendVar, getConfig, eosToken, tokenRepr,
                 tokensRepr, setLogLevel, inspect, log, AssertionError, assert, getTokens, getPromptLen,
                 MidProcessResult, PreProcessResult, PostProcessResult, NextToken, ConstrainedToken, PreToken,
                 fixed, $, forkSupported, fork, waitVars, getPrompt, start, test, Label, ChooseConstraint,
                 genTokens, gen, checkVar, checkVars, allTokens, Constraint, regexConstraint, cfgConstraint,
                 substrConstraint,
                 helpers: { regex_constraint: regexConstraint, cfg_constraint: cfgConstraint,
                            substr_constraint: substrConstraint, FixedTokens, StopToken, panic } };
  G.__tw_modules = { aici, _aici: native };
  for (const [k, v] of Object.entries(aici)) G[k] = v;
  G.console = console;
  String.prototype.toBuffer = function () { return stringToBuffer(this); };
  String.fromBuffer = bufferToString;
  Uint8Array.prototype.toString = function () { return bufferRepr(this); };
  Uint8Array.prototype.decode = function () { return bufferToString(this); };
})();
