/* The chat page: sidebar of conversations, streamed replies (Stop, Regenerate, Edit and
 * resend), export/import, the API key dialog, and "compare with no draft".  Loaded last, after
 * store.js (localStorage), api.js (requests, SSE), spec.js (speculation view and stats),
 * render.js (message DOM) and settings.js.
 */
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const ui = {
    messages: $('messages'), input: $('input'), send: $('send'), stop: $('stop'),
    convList: $('conv-list'), newChat: $('new-chat'), model: $('model-name'), draft: $('draft-name'),
    exportBtn: $('export-btn'), importInput: $('import-input'),
    keyDialog: $('api-key-dialog'), keyInput: $('api-key-input'), keySave: $('api-key-save'), keyMsg: $('api-key-msg'),
    toast: $('toast'), convTitle: $('conv-title'),
  };

  const state = {
    props: null,
    currentId: null,
    stream: null,                 // {convId, mid, msg, ctl}
    specShown: new Set(),         // message ids showing the speculation view
    reasoningOpen: new Set(),
    compares: new Map(),          // message id -> compare result (not saved)
    compareCtl: new Map(),
  };

  /* ---- helpers ------------------------------------------------------------------------- */

  let toastTimer = null;
  function toast(text, bad) {
    ui.toast.textContent = text;
    ui.toast.hidden = false;
    ui.toast.classList.toggle('bad', !!bad);
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { ui.toast.hidden = true; }, 4000);
  }

  function save(keepId) {
    Store.save(keepId || state.currentId);
    if (Store.warning) toast(Store.warning, true);
  }

  function errorText(e) {
    if (e && e.kind === 'context') return 'context overflow: ' + e.message;
    if (e && e.kind === 'auth') return 'API key required: ' + e.message;
    return String((e && e.message) || e || 'error');
  }

  const current = () => (state.currentId ? Store.get(state.currentId) : null);

  function setBusy(b) {
    ui.messages.dataset.busy = b ? '1' : '0';
    ui.stop.disabled = !b;
    ui.send.disabled = b;
  }

  const nearBottom = () => ui.messages.scrollHeight - ui.messages.scrollTop - ui.messages.clientHeight < 120;
  const toBottom = () => { ui.messages.scrollTop = ui.messages.scrollHeight; };

  /* ---- rendering ----------------------------------------------------------------------- */

  function renderSidebar() {
    ui.convList.textContent = '';
    for (const c of Store.list()) {
      const item = Render.el('div', 'conv-item' + (c.id === state.currentId ? ' active' : ''));
      item.dataset.id = c.id;
      const title = Render.el('span', 'conv-title', c.title || 'New chat');
      title.title = c.title || '';
      const streaming = state.stream && state.stream.convId === c.id;
      if (streaming) item.classList.add('streaming');
      item.append(title, Render.button('conv-rename', '✎', 'Rename'), Render.button('conv-delete', '✕', 'Delete'));
      ui.convList.append(item);
    }
    const conv = current();
    ui.convTitle.textContent = conv ? conv.title : '';
  }

  function uiOf(conv, msg, isLast) {
    return {
      isLast,
      busy: !!state.stream,
      streaming: !!(state.stream && state.stream.mid === msg.mid),
      specShown: state.specShown.has(msg.mid),
      reasoningOpen: state.reasoningOpen.has(msg.mid),
      compare: state.compares.get(msg.mid),
    };
  }

  /* Bring the shown messages up to date, in place for those still there (same ids, same
   * order): the elements a reader (or a test) holds stay valid. */
  function syncMessages() {
    const conv = current();
    if (!conv || !conv.messages.length) { renderMessages(true); return; }
    for (const e of Array.from(ui.messages.children)) if (!e.classList.contains('msg')) e.remove();
    const els = Array.from(ui.messages.children);
    let k = 0;
    while (k < els.length && k < conv.messages.length && els[k].dataset.mid === conv.messages[k].mid) k++;
    for (const e of els.slice(k)) e.remove();
    const last = conv.messages.length - 1;
    conv.messages.forEach((m, i) => {
      const u = uiOf(conv, m, i === last && m.role === 'assistant');
      if (i < k) Render.update(els[i], m, u);
      else ui.messages.append(Render.message(m, u));
    });
  }

  function renderMessages(keepScroll) {
    const conv = current();
    const top = ui.messages.scrollTop;
    ui.messages.textContent = '';
    if (!conv || !conv.messages.length) {
      const hint = Render.el('div', 'empty-hint');
      hint.append(Render.el('div', 'empty-title', 'Start a conversation'),
                  Render.el('div', 'empty-sub', 'Replies show, token by token, what the drafter guessed right: '
                    + 'switch a reply to "Tokens" to see it, or compare it with a run without the draft.'));
      ui.messages.append(hint);
      return;
    }
    const last = conv.messages.length - 1;
    conv.messages.forEach((m, i) => {
      ui.messages.append(Render.message(m, uiOf(conv, m, i === last && m.role === 'assistant')));
    });
    if (keepScroll) ui.messages.scrollTop = top;
    else toBottom();
  }

  function msgEl(mid) {
    return ui.messages.querySelector(`.msg[data-mid="${CSS.escape(mid)}"]`);
  }

  function refresh(convId, mid) {
    if (convId !== state.currentId) return;
    const conv = current();
    const i = conv ? conv.messages.findIndex((m) => m.mid === mid) : -1;
    const e = msgEl(mid);
    if (i < 0 || !e) return;
    const near = nearBottom();
    Render.update(e, conv.messages[i], uiOf(conv, conv.messages[i], i === conv.messages.length - 1));
    if (near && state.stream && state.stream.mid === mid) toBottom();
  }

  function open(id) {
    state.currentId = id;
    Store.setCurrent(id);
    renderSidebar();
    renderMessages();
  }

  /* ---- generation ---------------------------------------------------------------------- */

  function applyChunk(msg, c) {
    const ch = c.choices && c.choices[0];
    if (ch) {
      const d = ch.delta || {};
      if (typeof d.content === 'string') msg.content += d.content;
      if (typeof d.reasoning_content === 'string') msg.reasoning = (msg.reasoning || '') + d.reasoning_content;
      if (Array.isArray(d.tool_calls)) {
        msg.tool_calls = msg.tool_calls || [];
        for (const t of d.tool_calls) {
          const i = Number.isInteger(t.index) ? t.index : msg.tool_calls.length;
          const slot = msg.tool_calls[i] || (msg.tool_calls[i] = { id: '', type: 'function', function: { name: '', arguments: '' } });
          if (t.id) slot.id = t.id;
          if (t.type) slot.type = t.type;
          const f = t.function || {};
          if (f.name) slot.function.name += f.name;
          if (typeof f.arguments === 'string') slot.function.arguments += f.arguments;
          else if (f.arguments && typeof f.arguments === 'object') slot.function.arguments += JSON.stringify(f.arguments);
        }
        msg.tool_calls = msg.tool_calls.filter(Boolean);
      }
      if (ch.finish_reason) msg.finish_reason = ch.finish_reason;
    }
    if (c.timings && typeof c.timings === 'object') msg.timings = c.timings;
    const tr = c.dspark_trace;
    if (tr && typeof tr === 'object') {
      msg.trace = msg.trace || { tokens: [], cycles: [] };
      if (Array.isArray(tr.tokens)) for (const t of tr.tokens) msg.trace.tokens.push(t);
      if (Array.isArray(tr.cycles)) for (const cy of tr.cycles) msg.trace.cycles.push(cy);
    }
  }

  async function generate(conv) {
    if (!state.props) loadProps();
    const upto = conv.messages.length;
    const msg = { mid: Store.uid('m'), role: 'assistant', content: '', pending: true };
    conv.messages.push(msg);
    conv.updated = Date.now();
    const ctl = new AbortController();
    state.stream = { convId: conv.id, mid: msg.mid, msg, ctl };
    save(conv.id);
    setBusy(true);
    renderSidebar();
    if (conv.id === state.currentId) { syncMessages(); toBottom(); }
    let timer = null;
    let lastSave = Date.now();
    const tick = () => {
      timer = null;
      if (Date.now() - lastSave > 2000) { lastSave = Date.now(); save(conv.id); }
      refresh(conv.id, msg.mid);
    };
    try {
      await Api.stream('/v1/chat/completions', Settings.buildBody(conv, upto), {
        signal: ctl.signal,
        onChunk(c) {
          applyChunk(msg, c);
          if (!timer) timer = setTimeout(tick, 40);
        },
      });
    } catch (e) {
      if (e && e.name === 'AbortError') msg.stopped = true;
      else msg.error = errorText(e);
    }
    if (timer) clearTimeout(timer);
    delete msg.pending;
    state.stream = null;
    conv.updated = Date.now();
    try {
      save(conv.id);
      renderSidebar();
      const near = nearBottom();
      if (conv.id === state.currentId) syncMessages();
      if (conv.id === state.currentId && near) toBottom();
    } finally {
      setBusy(false);
    }
  }

  function send() {
    const text = ui.input.value;
    if (!text.trim() || state.stream) return;
    let conv = current();
    if (!conv) {
      conv = Store.create();
      state.currentId = conv.id;
      Store.setCurrent(conv.id);
    }
    conv.messages.push({ mid: Store.uid('m'), role: 'user', content: text });
    if (!conv.titleSet && conv.messages.filter((m) => m.role === 'user').length === 1) conv.title = Store.titleFrom(text);
    ui.input.value = '';
    autosize();
    generate(conv);
  }

  function editAndResend(conv, msg, text) {
    if (state.stream) { toast('Wait for the reply to finish (or stop it) first', true); return; }
    const i = conv.messages.indexOf(msg);
    if (i < 0) return;
    msg.content = text;
    for (const m of conv.messages.slice(i + 1)) forget(m.mid);
    conv.messages.splice(i + 1);
    if (!conv.titleSet && conv.messages.find((m) => m.role === 'user') === msg) conv.title = Store.titleFrom(text);
    generate(conv);
  }

  function regenerate(conv, msg) {
    if (state.stream) return;
    const i = conv.messages.indexOf(msg);
    if (i < 0) return;
    for (const m of conv.messages.slice(i)) forget(m.mid);
    conv.messages.splice(i);
    generate(conv);
  }

  function forget(mid) {
    state.specShown.delete(mid);
    state.reasoningOpen.delete(mid);
    state.compares.delete(mid);
    const ctl = state.compareCtl.get(mid);
    if (ctl) ctl.abort();
  }

  async function compare(conv, msg) {
    if (state.compareCtl.has(msg.mid)) return;
    const i = conv.messages.indexOf(msg);
    if (i < 0) return;
    const body = Settings.buildBody(conv, i);
    const ctl = new AbortController();
    state.compareCtl.set(msg.mid, ctl);
    const show = (r) => { state.compares.set(msg.mid, Object.assign({}, r)); refresh(conv.id, msg.mid); };
    try {
      await Spec.compare(body, body.temperature != null ? body.temperature : 0, ctl.signal, show);
    } catch (e) {
      const r = Object.assign({}, state.compares.get(msg.mid) || {});
      r.state = 'error';
      r.step = null;
      r.error = e && e.name === 'AbortError' ? 'cancelled' : errorText(e);
      show(r);
    } finally {
      state.compareCtl.delete(msg.mid);
    }
  }

  /* ---- the API key --------------------------------------------------------------------- */

  let keyResolve = null;
  Api.askKey = (reason) => new Promise((resolve) => {
    keyResolve = resolve;
    ui.keyMsg.textContent = (Store.apiKey() ? 'The server refused the key' : 'The server needs an API key')
      + (reason ? ` (${reason}).` : '.');
    ui.keyInput.value = '';
    Render.showDialog(ui.keyDialog);
    ui.keyInput.focus();
  });

  function keyDone(key) {
    const r = keyResolve;
    keyResolve = null;
    Render.closeDialog(ui.keyDialog);
    if (r) r(key);
  }

  /* ---- the server's properties ------------------------------------------------------- */

  let propsTries = 0;
  let propsLoading = null;
  function loadProps() {
    if (propsLoading) return propsLoading;
    propsLoading = (async () => {
      try {
        const p = await Api.json('/props');
        state.props = p;
        Settings.setProps(p);
        propsTries = 0;
        const alias = p.model_alias || (p.model_path || '').split(/[\\/]/).pop() || 'model';
        ui.model.textContent = alias;
        ui.model.title = p.model_path || alias;
        const d = p.dspark || {};
        ui.draft.textContent = d.draft ? d.draft : 'no draft';
        ui.draft.title = d.draft ? `draft kind ${d.draft_kind || '?'}, block of ${d.n_max} tokens` : 'the server runs no draft';
        ui.draft.classList.toggle('none', !d.draft);
        document.title = alias + ' · pyllama-dspark';
      } catch (e) {
        ui.model.textContent = e && e.kind === 'unreachable' ? 'server unreachable' : 'unknown model';
        ui.model.title = errorText(e);
        if (e && e.kind === 'unreachable' && ++propsTries < 4) setTimeout(loadProps, 3000 * propsTries);
      } finally {
        propsLoading = null;
      }
    })();
    return propsLoading;
  }

  /* ---- wiring -------------------------------------------------------------------------- */

  function autosize() {
    ui.input.style.height = 'auto';
    ui.input.style.height = Math.min(ui.input.scrollHeight + 2, 240) + 'px';
  }

  ui.input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  ui.input.addEventListener('input', autosize);
  ui.send.addEventListener('click', send);
  ui.stop.addEventListener('click', () => { if (state.stream) state.stream.ctl.abort(); });

  ui.newChat.addEventListener('click', () => {
    const c = Store.create();
    open(c.id);
    ui.input.focus();
  });

  ui.convList.addEventListener('click', (e) => {
    const item = e.target.closest('.conv-item');
    if (!item) return;
    const id = item.dataset.id;
    const conv = Store.get(id);
    if (!conv) return;
    if (e.target.closest('.conv-rename')) {
      const name = window.prompt('Rename the conversation', conv.title);
      if (name != null && name.trim()) {
        Store.rename(id, name);
        renderSidebar();
      }
    } else if (e.target.closest('.conv-delete')) {
      if (!window.confirm(`Delete the conversation "${conv.title}"?`)) return;
      if (state.stream && state.stream.convId === id) state.stream.ctl.abort();
      for (const m of conv.messages) forget(m.mid);
      Store.remove(id);
      if (state.currentId === id) {
        const next = Store.list()[0];
        state.currentId = null;
        if (next) open(next.id);
        else { Store.setCurrent(null); renderSidebar(); renderMessages(); }
      } else renderSidebar();
    } else if (id !== state.currentId) {
      open(id);
    }
  });

  ui.messages.addEventListener('click', (e) => {
    const b = e.target.closest('button');
    const m = b && b.closest('.msg');
    const conv = current();
    if (!m || !conv || b.disabled) return;
    const msg = conv.messages.find((x) => x.mid === m.dataset.mid);
    if (!msg) return;
    if (b.classList.contains('msg-edit')) {
      if (state.stream) return;
      Render.editor(m, msg.content, (text) => editAndResend(conv, msg, text));
    } else if (b.classList.contains('msg-copy')) {
      Render.copyText(msg.role === 'assistant' ? Render.splitThink(msg.content).reply : msg.content, b);
    } else if (b.classList.contains('spec-toggle')) {
      if (state.specShown.has(msg.mid)) state.specShown.delete(msg.mid);
      else state.specShown.add(msg.mid);
      refresh(conv.id, msg.mid);
    } else if (b.classList.contains('compare-btn')) {
      compare(conv, msg);
    } else if (b.classList.contains('msg-regen')) {
      regenerate(conv, msg);
    }
  });

  // <details> toggles do not bubble: listen in the capture phase to remember them.
  ui.messages.addEventListener('toggle', (e) => {
    const d = e.target;
    if (!d.classList || !d.classList.contains('msg-reasoning')) return;
    const m = d.closest('.msg');
    if (!m) return;
    if (d.open) state.reasoningOpen.add(m.dataset.mid);
    else state.reasoningOpen.delete(m.dataset.mid);
  }, true);

  Settings.init(toast);

  ui.keySave.addEventListener('click', () => {
    const k = ui.keyInput.value.trim();
    if (!k) { ui.keyInput.focus(); return; }
    Store.setApiKey(k);
    keyDone(k);
  });
  ui.keyInput.addEventListener('keydown', (e) => {
    if (e.key === 'Enter') { e.preventDefault(); ui.keySave.click(); }
  });
  $('api-key-form').addEventListener('submit', (e) => e.preventDefault());
  ui.keyDialog.addEventListener('cancel', () => keyDone(null));
  ui.keyDialog.addEventListener('close', () => { if (keyResolve) keyDone(null); });

  ui.exportBtn.addEventListener('click', () => {
    const blob = new Blob([Store.exportJson()], { type: 'application/json' });
    const a = document.createElement('a');
    a.href = URL.createObjectURL(blob);
    a.download = 'pyllama-dspark-conversations-' + new Date().toISOString().slice(0, 19).replace(/[:T]/g, '-') + '.json';
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 30000);
  });

  ui.importInput.addEventListener('change', async () => {
    const files = Array.from(ui.importInput.files || []);
    let added = 0;
    try {
      for (const f of files) added += Store.importJson(await f.text());
      toast(`Imported ${added} conversation${added === 1 ? '' : 's'}`);
    } catch (e) {
      toast('Import failed: ' + (e && e.message ? e.message : e), true);
    }
    ui.importInput.value = '';
    if (!current() && Store.list().length) open(Store.list()[0].id);
    else renderSidebar();
  });

  window.addEventListener('beforeunload', () => { if (state.stream) save(); });

  /* ---- start --------------------------------------------------------------------------- */

  const last = Store.currentId();
  state.currentId = last && Store.get(last) ? last : ((Store.list()[0] || {}).id || null);
  if (state.currentId) Store.setCurrent(state.currentId);
  setBusy(false);
  renderSidebar();
  renderMessages();
  loadProps();
  ui.input.focus();
})();
