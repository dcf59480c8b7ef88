/* Conversations, settings and the API key, kept in localStorage.
 *
 * A conversation: {id, title, titleSet, created, updated, messages: [message]}; a message:
 * {mid, role: "user"|"assistant"|"system", content, reasoning?, tool_calls?, trace?: {tokens, cycles},
 *  timings?, error?, stopped?, finish_reason?}.  Exports are {format, version, exported, conversations}.
 */
'use strict';

const Store = (() => {
  const K = {
    convs: 'dspark.conversations',
    current: 'dspark.current',
    settings: 'dspark.settings',
    key: 'dspark.apiKey',
  };
  const FORMAT = 'pyllama-dspark-webui';

  function read(key, dflt) {
    try {
      const v = localStorage.getItem(key);
      return v == null ? dflt : JSON.parse(v);
    } catch (e) {
      return dflt;
    }
  }

  function uid(prefix) {
    return (prefix || '') + Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
  }

  function titleFrom(text) {
    const line = String(text || '').replace(/\s+/g, ' ').trim();
    if (!line) return 'New chat';
    return line.length > 48 ? line.slice(0, 47) + '…' : line;
  }

  const str = (v) => (typeof v === 'string' ? v : '');
  const num = (v, d) => (typeof v === 'number' && isFinite(v) ? v : d);

  function normMessage(m) {
    if (!m || typeof m !== 'object') return null;
    const role = ['user', 'assistant', 'system', 'tool'].includes(m.role) ? m.role : null;
    if (!role) return null;
    let content = m.content;
    if (Array.isArray(content)) {   // OpenAI content parts: keep the text ones
      content = content.map((p) => (p && typeof p.text === 'string' ? p.text : '')).join('');
    }
    const out = { mid: typeof m.mid === 'string' && m.mid ? m.mid : uid('m'), role, content: str(content) };
    if (typeof m.reasoning === 'string' && m.reasoning) out.reasoning = m.reasoning;
    else if (typeof m.reasoning_content === 'string' && m.reasoning_content) out.reasoning = m.reasoning_content;
    else if (typeof m.thinking === 'string' && m.thinking) out.reasoning = m.thinking;
    if (Array.isArray(m.tool_calls) && m.tool_calls.length) out.tool_calls = m.tool_calls;
    if (m.trace && Array.isArray(m.trace.tokens) && Array.isArray(m.trace.cycles)) out.trace = m.trace;
    if (m.timings && typeof m.timings === 'object') out.timings = m.timings;
    if (typeof m.error === 'string' && m.error) out.error = m.error;
    if (m.stopped) out.stopped = true;
    if (typeof m.finish_reason === 'string') out.finish_reason = m.finish_reason;
    if (m.pending) out.error = out.error || 'the page was closed while this reply streamed';
    return out;
  }

  function normConv(c) {
    if (!c || typeof c !== 'object') return null;
    // llama-server's export shape: {conv: {id, name, lastModified}, messages: [...]}
    const meta = c.conv && typeof c.conv === 'object' ? c.conv : c;
    const msgs = Array.isArray(c.messages) ? c.messages : [];
    const messages = msgs.map(normMessage).filter(Boolean);
    const created = num(meta.created, num(meta.lastModified, num(meta.updated, Date.now())));
    const title = str(meta.title) || str(meta.name);
    return {
      id: typeof meta.id === 'string' && meta.id ? meta.id : (meta.id != null ? String(meta.id) : uid('c')),
      title: title || titleFrom((messages.find((m) => m.role === 'user') || {}).content),
      titleSet: !!meta.titleSet || (!!title && !('titleSet' in meta) && !!c.conv),
      created,
      updated: num(meta.updated, num(meta.lastModified, created)),
      messages,
    };
  }

  let convs = (Array.isArray(read(K.convs, [])) ? read(K.convs, []) : []).map(normConv).filter(Boolean);
  let warning = null;

  function list() {
    return convs.slice().sort((a, b) => b.created - a.created);
  }

  function get(id) {
    return convs.find((c) => c.id === id) || null;
  }

  function create() {
    const now = Date.now();
    const last = convs.reduce((t, c) => Math.max(t, c.created), 0);
    const c = { id: uid('c'), title: 'New chat', titleSet: false, created: Math.max(now, last + 1), updated: now,
                messages: [] };
    convs.push(c);
    save();
    return c;
  }

  function remove(id) {
    convs = convs.filter((c) => c.id !== id);
    if (currentId() === id) setCurrent(null);
    save();
  }

  function rename(id, title) {
    const c = get(id);
    if (!c) return;
    c.title = String(title).trim().slice(0, 200) || c.title;
    c.titleSet = true;
    save();
  }

  /* Save everything; when the browser's quota is full, drop the token traces of the other
   * conversations (oldest first) until it fits.  Returns false when even that failed. */
  function save(keepId) {
    warning = null;
    for (let attempt = 0; attempt < 1000; attempt++) {
      try {
        localStorage.setItem(K.convs, JSON.stringify(convs));
        return true;
      } catch (e) {
        const victim = convs.slice().sort((a, b) => a.updated - b.updated)
          .find((c) => c.id !== keepId && c.messages.some((m) => m.trace && m.trace.tokens.length));
        if (!victim) {
          warning = 'Browser storage is full: the latest changes are not saved.';
          return false;
        }
        for (const m of victim.messages) if (m.trace) m.trace = { tokens: [], cycles: m.trace.cycles, dropped: true };
        warning = 'Browser storage was full: older token traces were dropped.';
      }
    }
    return false;
  }

  function currentId() {
    return localStorage.getItem(K.current) || null;
  }

  function setCurrent(id) {
    try {
      if (id) localStorage.setItem(K.current, id);
      else localStorage.removeItem(K.current);
    } catch (e) { /* quota: not important */ }
  }

  const SETTINGS_DEFAULT = { systemPrompt: '', temperature: null, topP: null, maxTokens: -1, draftOn: true };

  function settings() {
    const s = read(K.settings, {});
    return Object.assign({}, SETTINGS_DEFAULT, s && typeof s === 'object' ? s : {});
  }

  function saveSettings(s) {
    localStorage.setItem(K.settings, JSON.stringify(Object.assign({}, SETTINGS_DEFAULT, s)));
  }

  function apiKey() {
    return localStorage.getItem(K.key) || '';
  }

  function setApiKey(k) {
    if (k) localStorage.setItem(K.key, k);
    else localStorage.removeItem(K.key);
  }

  function exportJson() {
    return JSON.stringify({ format: FORMAT, version: 1, exported: new Date().toISOString(), conversations: convs },
                          null, 1);
  }

  const sameMessages = (a, b) => JSON.stringify(a.messages.map((m) => [m.role, m.content]))
    === JSON.stringify(b.messages.map((m) => [m.role, m.content]));

  /* Merge an export (ours, a bare array, or llama-server's) in; returns how many were added. */
  function importJson(text) {
    const data = JSON.parse(text);
    let items = Array.isArray(data) ? data : (data && (data.conversations || data.convs));
    if (!Array.isArray(items) && data && data.messages) items = [data];
    if (!Array.isArray(items)) throw new Error('not an export of conversations');
    let added = 0;
    for (const raw of items) {
      const c = normConv(raw);
      if (!c) continue;
      const old = get(c.id);
      if (old) {
        if (sameMessages(old, c)) continue;
        c.id = uid('c');
      }
      const mids = new Set();
      for (const m of c.messages) {     // message ids must stay unique on the page
        if (mids.has(m.mid) || convs.some((o) => o.messages.some((x) => x.mid === m.mid))) m.mid = uid('m');
        mids.add(m.mid);
      }
      convs.push(c);
      added++;
    }
    save();
    return added;
  }

  return {
    uid, titleFrom, list, get, create, remove, rename, save, currentId, setCurrent,
    settings, saveSettings, apiKey, setApiKey, exportJson, importJson,
    get warning() { return warning; },
  };
})();
