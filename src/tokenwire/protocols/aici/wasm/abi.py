"""tokenwire's Wasm controller ABI, version 1 (documented in docs/aici-controllers.md).

A controller module exports `memory`, `tw_alloc(size) -> ptr` and the callbacks
`init_prompt(ptr, n) -> i32`, `pre_process() -> i32`, `mid_process() -> i32`,
`post_process(backtrack, ptr, n) -> i32` (token lists are i32 arrays in linear memory; a
nonzero return fails the sequence with that code). It imports host functions from module
"tw"; results are reported by calling the `set_*` / `bias_*` imports during the callback.
"""

from __future__ import annotations

from wasmtime import FuncType, ValType

I32 = ValType.i32()


def sig(params: int, results: int) -> FuncType:
    return FuncType([I32] * params, [I32] * results)


# name -> (number of i32 params, number of i32 results); every import lives in module "tw"
IMPORTS: dict[str, tuple[int, int]] = {
    "arg_len": (0, 1),  # length of the controller argument (UTF-8)
    "arg_read": (2, 1),  # (ptr, cap) -> bytes written
    "vocab_size": (0, 1),
    "eos_token": (0, 1),
    "fork_index": (0, 1),  # 0 for the original sequence, i for the clone of fork i
    "tokenize": (4, 1),  # (text_ptr, text_len, out_ptr, out_cap) -> number of tokens (all of them)
    "token_bytes": (3, 1),  # (token, out_ptr, out_cap) -> length of the token's bytes
    "var_get": (4, 1),  # (name_ptr, name_len, out_ptr, out_cap) -> length, or -1 when unset
    "var_set": (5, 0),  # (name_ptr, name_len, val_ptr, val_len, append)
    "log": (2, 0),  # (ptr, len): UTF-8 text to the sequence's logs
    "set_suspend": (0, 0),  # pre_process
    "set_num_forks": (1, 0),  # pre_process; 0 stops the sequence
    "set_ff_tokens": (2, 0),  # (ptr, n): pre_process or mid_process
    "set_backtrack": (1, 0),  # mid_process
    "bias_disallow_all": (0, 0),  # mid_process: start from "nothing allowed"
    "bias_allow_all": (0, 0),
    "bias_allow": (1, 0),  # (token)
    "bias_disallow": (1, 0),  # (token)
    "bias_allow_bits": (1, 0),  # (ptr): OR a bitset of ceil(vocab/32) little-endian u32 words
    "set_stop": (0, 0),  # post_process
}

EXPORTS = ("memory", "tw_alloc", "init_prompt", "pre_process", "mid_process", "post_process")
