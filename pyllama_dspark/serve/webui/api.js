/* The server's API: JSON requests and server-sent-event streams, with the API key.
 *
 * Errors are thrown as ApiError {message, kind, status, type}: kind "http" (the server's
 * {"error": {...}} answer), "context" (exceed_context_size_error), "unreachable" (fetch failed),
 * "stream" (an error chunk mid-stream), "auth" (401 and no key given).  A Stop (AbortController)
 * rethrows the browser's AbortError untouched.
 */
'use strict';

const Api = (() => {
  class ApiError extends Error {
    constructor(message, kind, status, type) {
      super(message);
      this.name = 'ApiError';
      this.kind = kind;
      this.status = status || 0;
      this.type = type || '';
    }
  }

  // Set by the page: async (reason) => the key typed in, or null when the dialog was dismissed.
  let askKey = async () => null;
  let asking = null;

  function headers(json) {
    const h = {};
    if (json) h['Content-Type'] = 'application/json';
    const key = Store.apiKey();
    if (key) h.Authorization = 'Bearer ' + key;
    return h;
  }

  function errorOf(status, statusText, text) {
    let body = null;
    try { body = JSON.parse(text); } catch (e) { /* not JSON */ }
    const err = body && body.error;
    if (err && typeof err === 'object') {
      const message = String(err.message || err.type || ('HTTP ' + status));
      const type = String(err.type || '');
      const kind = type === 'exceed_context_size_error' ? 'context' : 'http';
      return new ApiError(message, kind, status, type);
    }
    if (typeof err === 'string') return new ApiError(err, 'http', status);
    const snippet = (text || '').trim().slice(0, 300);
    return new ApiError(`HTTP ${status} ${statusText || ''}`.trim() + (snippet ? ': ' + snippet : ''), 'http', status);
  }

  /* fetch with the key; on 401 ask for a key (once for all callers waiting) and retry. */
  async function request(path, opts) {
    opts = opts || {};
    for (let tries = 0; ; tries++) {
      let res;
      try {
        res = await fetch(path, {
          method: opts.method || (opts.body !== undefined ? 'POST' : 'GET'),
          headers: headers(opts.body !== undefined),
          body: opts.body !== undefined ? JSON.stringify(opts.body) : undefined,
          signal: opts.signal,
          cache: 'no-store',
        });
      } catch (e) {
        if (e && e.name === 'AbortError') throw e;
        throw new ApiError('server unreachable', 'unreachable');
      }
      if (res.ok) return res;
      const text = await res.text().catch(() => '');
      const err = errorOf(res.status, res.statusText, text);
      if (res.status !== 401 || tries >= 5) throw err;
      if (!asking) {
        asking = Promise.resolve(askKey(err.message)).finally(() => { asking = null; });
      }
      const key = await asking;
      if (opts.signal && opts.signal.aborted) throw new DOMException('aborted', 'AbortError');
      if (!key) throw new ApiError(err.message || 'invalid API key', 'auth', 401, err.type);
    }
  }

  async function json(path, opts) {
    const res = await request(path, opts);
    const text = await res.text();
    try {
      return JSON.parse(text);
    } catch (e) {
      throw new ApiError('the server answered something that is not JSON', 'http', res.status);
    }
  }

  /* POST body (with stream: true) and call onChunk(obj) for every `data: {json}` event.
   * Resolves {finish_reason, done} at `data: [DONE]` or at the end of the stream. */
  async function stream(path, body, opts) {
    const res = await request(path, { body, signal: opts.signal });
    const onChunk = opts.onChunk || (() => {});
    const ctype = res.headers.get('content-type') || '';
    let finish = null;
    if (!ctype.includes('text/event-stream')) {       // a server that answered without streaming
      const text = await res.text();
      let obj;
      try { obj = JSON.parse(text); } catch (e) { throw new ApiError('the server answered something that is not JSON', 'http', res.status); }
      if (obj && obj.error) throw errorOf(res.status, '', text);
      const ch = obj && obj.choices && obj.choices[0];
      if (ch && ch.message) {
        const m = ch.message;
        onChunk({ choices: [{ delta: { content: m.content || '', reasoning_content: m.reasoning_content,
                                       tool_calls: m.tool_calls }, finish_reason: ch.finish_reason }],
                  timings: obj.timings });
      }
      return { finish_reason: ch ? ch.finish_reason : null, done: true };
    }
    const reader = res.body.getReader();
    const dec = new TextDecoder('utf-8');
    let buf = '';
    let data = [];
    let done = false;

    function dispatch() {
      if (!data.length) return;
      const payload = data.join('\n');
      data = [];
      if (payload.trim() === '[DONE]') { done = true; return; }
      let obj;
      try { obj = JSON.parse(payload); } catch (e) { return; }   // not JSON: skip, as browsers do
      if (obj && obj.error) {
        const err = obj.error;
        const msg = typeof err === 'string' ? err : String(err.message || err.type || 'error');
        const type = typeof err === 'object' ? String(err.type || '') : '';
        throw new ApiError(msg, type === 'exceed_context_size_error' ? 'context' : 'stream', err.code || 0, type);
      }
      const ch = obj && obj.choices && obj.choices[0];
      if (ch && ch.finish_reason) finish = ch.finish_reason;
      onChunk(obj);
    }

    function line(l) {
      if (l.endsWith('\r')) l = l.slice(0, -1);
      if (l === '') { dispatch(); return; }
      if (l.startsWith(':')) return;                            // a comment (ping)
      const i = l.indexOf(':');
      const field = i < 0 ? l : l.slice(0, i);
      let value = i < 0 ? '' : l.slice(i + 1);
      if (value.startsWith(' ')) value = value.slice(1);
      if (field === 'data') data.push(value);
    }

    try {
      while (!done) {
        let r;
        try {
          r = await reader.read();
        } catch (e) {
          if (e && e.name === 'AbortError') throw e;
          if (opts.signal && opts.signal.aborted) throw new DOMException('aborted', 'AbortError');
          throw new ApiError('server unreachable: the connection was lost mid-reply', 'unreachable');
        }
        if (r.done) break;
        buf += dec.decode(r.value, { stream: true });
        let nl;
        while (!done && (nl = buf.indexOf('\n')) >= 0) {
          const l = buf.slice(0, nl);
          buf = buf.slice(nl + 1);
          line(l);
        }
      }
      if (!done) {
        buf += dec.decode();
        if (buf) line(buf);
        dispatch();
      }
    } finally {
      if (done) reader.cancel().catch(() => {});
    }
    if (!done && !finish) {
      throw new ApiError('server unreachable: the reply stream ended before it finished', 'unreachable');
    }
    return { finish_reason: finish, done };
  }

  return {
    ApiError, request, json, stream,
    set askKey(fn) { askKey = fn; },
  };
})();
