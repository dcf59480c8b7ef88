/* Settings (system prompt, temperature, top-p, max tokens, draft on/off): the dialog, what is
 * kept in localStorage (null: follow the server's default from /props), and the request body
 * of a reply built from them.
 */
'use strict';

const Settings = (() => {
  let props = null;
  const $ = (id) => document.getElementById(id);
  const n = (v) => (typeof v === 'number' && isFinite(v) ? v : null);

  function setProps(p) { props = p; }

  function serverDefaults() {
    const p = (props && props.default_generation_settings && props.default_generation_settings.params) || {};
    return { temperature: n(p.temperature), topP: n(p.top_p) };
  }

  function effective() {
    const s = Store.settings();
    const d = serverDefaults();
    return {
      systemPrompt: typeof s.systemPrompt === 'string' ? s.systemPrompt : '',
      temperature: n(s.temperature) != null ? s.temperature : d.temperature,
      topP: n(s.topP) != null ? s.topP : d.topP,
      maxTokens: Number.isInteger(s.maxTokens) && s.maxTokens > 0 ? s.maxTokens : -1,
      draftOn: s.draftOn !== false,
    };
  }

  function open() {
    const e = effective();
    const d = serverDefaults();
    $('system-prompt').value = e.systemPrompt;
    $('temperature').value = e.temperature != null ? String(e.temperature) : '';
    $('top-p').value = e.topP != null ? String(e.topP) : '';
    $('max-tokens').value = String(e.maxTokens);
    $('draft-on').checked = e.draftOn;
    const draft = props && props.dspark;
    $('settings-info').textContent = `Server defaults: temperature ${d.temperature ?? '?'}, top-p ${d.topP ?? '?'}; `
      + (draft && draft.draft ? `draft ${draft.draft} (block of ${draft.n_max}).` : 'the server runs no draft.')
      + ' Max tokens -1: no limit.';
    Render.showDialog($('settings-dialog'));
  }

  function save() {
    const d = serverDefaults();
    const num = (id, dflt) => {
      const v = parseFloat($(id).value);
      if (!isFinite(v)) return null;
      return dflt != null && v === dflt ? null : v;     // the server's default: follow the server
    };
    let max = parseInt($('max-tokens').value, 10);
    if (!isFinite(max) || max <= 0) max = -1;
    Store.saveSettings({
      systemPrompt: $('system-prompt').value,
      temperature: num('temperature', d.temperature),
      topP: num('top-p', d.topP),
      maxTokens: max,
      draftOn: $('draft-on').checked,
    });
    Render.closeDialog($('settings-dialog'));
  }

  function reset() {
    const d = serverDefaults();
    $('temperature').value = d.temperature != null ? String(d.temperature) : '';
    $('top-p').value = d.topP != null ? String(d.topP) : '';
    $('max-tokens').value = '-1';
    $('draft-on').checked = true;
  }

  /* The request of the reply at index `upto` of a conversation (the messages before it). */
  function buildBody(conv, upto) {
    const s = effective();
    const messages = [];
    if (s.systemPrompt.trim()) messages.push({ role: 'system', content: s.systemPrompt });
    for (const m of conv.messages.slice(0, upto)) {
      if (m.role === 'assistant') {
        const reply = Render.splitThink(m.content).reply;
        if (reply || m.error == null) messages.push({ role: 'assistant', content: reply });
      } else if (m.role === 'user' || m.role === 'system') {
        messages.push({ role: m.role, content: m.content });
      }
    }
    const body = { messages, stream: true, dspark_trace: true, timings_per_token: true };
    if (s.temperature != null) body.temperature = s.temperature;
    if (s.topP != null) body.top_p = s.topP;
    if (s.maxTokens > 0) body.max_tokens = s.maxTokens;
    if (!s.draftOn) body['speculative.n_max'] = 0;
    return body;
  }

  function init(toast) {
    $('settings-btn').addEventListener('click', open);
    $('settings-save').addEventListener('click', () => { save(); if (toast) toast('Settings saved'); });
    $('settings-cancel').addEventListener('click', () => Render.closeDialog($('settings-dialog')));
    $('settings-reset').addEventListener('click', reset);
  }

  return { setProps, serverDefaults, effective, buildBody, init };
})();
