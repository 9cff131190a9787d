// The playground's only way out: this server's own HTTP API (same origin).

// An API key, when the server has --api-key: open the page as /#key=KEY (kept for this tab).
const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
if (fromHash) sessionStorage.setItem("tokenwire-api-key", fromHash);
const apiKey = () => sessionStorage.getItem("tokenwire-api-key");

export class ApiError extends Error {
  constructor(message, status, param) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function fail(response) {
  let message = `${response.status} ${response.statusText}`;
  let param = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message;
      param = body.error.param;
    }
  } catch (_) { /* not JSON */ }
  throw new ApiError(message, response.status, param);
}

export async function call(method, path, body) {
  const response = await fetch(path, {
    method,
    headers: headers(),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) await fail(response);
  return response.json();
}

// POST a streaming request; `onChunk` gets each server-sent event's JSON. An error sent inside
// the stream (after its first chunk) is thrown as an ApiError like one sent as the status.
export async function stream(path, body, onChunk, signal) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!response.ok) await fail(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.message, 500, chunk.error.param);
        onChunk(chunk);
      }
    }
  }
}
