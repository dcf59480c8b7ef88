/* The DOM of messages: Markdown (marked + DOMPurify, highlight.js), reasoning, tool calls,
 * errors, the speculation view and stats.  Model and user text reach the DOM only through
 * textContent or DOMPurify.sanitize(marked.parse(text)).
 */
'use strict';

const Render = (() => {
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  }

  function button(cls, label, title) {
    const b = el('button', cls, label);
    b.type = 'button';
    if (title) b.title = title;
    return b;
  }

  const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
  const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);
  /* Whether DOMPurify works here (it sanitizes a probe); without it, replies show as plain text. */
  function purifyWorks() {
    if (typeof DOMPurify === 'undefined' || typeof DOMPurify.sanitize !== 'function') return false;
    try {
      const out = DOMPurify.sanitize('<b>x</b><img src=x onerror=alert(1)>');
      return typeof out === 'string' && out.includes('<b>x</b>') && !/onerror/i.test(out);
    } catch (e) {
      return false;
    }
  }
  const haveMarkdown = typeof marked !== 'undefined' && purifyWorks();

  if (typeof hljs !== 'undefined' && hljs.configure) {
    hljs.configure({ hideUpgradeWarningAcceptNoSupportOrSecurityUpdates: true });
  }

  if (haveMarkdown) {
    // Raw HTML in a reply is shown as text (and everything is sanitized anyway).
    marked.use({ renderer: { html(html) { return escapeHtml(typeof html === 'string' ? html : (html && html.text) || ''); } } });
    marked.setOptions({ gfm: true, breaks: true, headerIds: false, mangle: false });
    DOMPurify.addHook('afterSanitizeAttributes', (node) => {
      if (node.tagName === 'A' && node.hasAttribute('href')) {
        node.setAttribute('target', '_blank');
        node.setAttribute('rel', 'noopener noreferrer');
      }
    });
  }

  /* A leading <think>...</think> of the content: {reasoning, reply, open (not closed yet)}. */
  function splitThink(content) {
    const m = /^\s*<think>/.exec(content || '');
    if (!m) return { reasoning: '', reply: content || '', open: false };
    const rest = content.slice(m[0].length);
    const end = rest.indexOf('</think>');
    if (end < 0) return { reasoning: rest, reply: '', open: true };
    return { reasoning: rest.slice(0, end), reply: rest.slice(end + 8).replace(/^\s+/, ''), open: false };
  }

  async function copyText(text, btn) {
    let ok = false;
    try {
      if (navigator.clipboard && window.isSecureContext) {
        await navigator.clipboard.writeText(text);
        ok = true;
      }
    } catch (e) { /* fall back below */ }
    if (!ok) {
      const ta = el('textarea');
      ta.value = text;
      ta.setAttribute('readonly', '');
      ta.style.position = 'fixed';
      ta.style.opacity = '0';
      document.body.append(ta);
      ta.select();
      try { ok = document.execCommand('copy'); } catch (e) { ok = false; }
      ta.remove();
    }
    if (btn) {
      const old = btn.dataset.label || btn.textContent;
      btn.dataset.label = old;
      btn.textContent = ok ? 'Copied' : 'Copy failed';
      setTimeout(() => { btn.textContent = old; }, 1200);
    }
  }

  function markdown(box, text) {
    let ok = false;
    if (haveMarkdown) {
      try {
        box.innerHTML = DOMPurify.sanitize(marked.parse(text));   // the only HTML that reaches the page
        ok = true;
      } catch (e) { ok = false; }
    }
    box.classList.toggle('plain', !ok);
    if (!ok) { box.textContent = text; return; }
    for (const code of box.querySelectorAll('pre > code')) {
      const pre = code.parentNode;
      const m = /\blang(?:uage)?-([\w+#.-]+)/i.exec(code.className);
      if (m && typeof hljs !== 'undefined' && !hljs.getLanguage(m[1])) code.className = '';
      if (typeof hljs !== 'undefined') {
        try { hljs.highlightBlock(code); } catch (e) { /* leave it plain */ }
      }
      const wrap = el('div', 'code-wrap');
      pre.replaceWith(wrap);
      const copy = button('code-copy', 'Copy', 'Copy the code');
      copy.addEventListener('click', () => copyText(code.textContent, copy));
      wrap.append(copy, pre);
    }
  }

  function toolCalls(box, calls) {
    box.textContent = '';
    for (const c of calls) {
      const f = c.function || {};
      const item = el('div', 'tool-call');
      const head = el('div', 'tool-head');
      head.append(el('span', 'tool-tag', 'tool call'), el('span', 'tool-name', f.name || '(unnamed)'));
      if (c.id) head.append(el('span', 'tool-id', c.id));
      let args = f.arguments || '';
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* still arriving, or not JSON */ }
      item.append(head, el('pre', 'tool-args', args));
      box.append(item);
    }
  }

  function child(msgEl, cls, tag, before) {
    let c = msgEl.querySelector(':scope > .' + cls);
    if (!c) {
      c = el(tag || 'div', cls);
      const ref = before ? msgEl.querySelector(':scope > .' + before) : null;
      if (ref) msgEl.insertBefore(c, ref);
      else msgEl.append(c);
    }
    return c;
  }

  function drop(msgEl, cls) {
    const c = msgEl.querySelector(':scope > .' + cls);
    if (c) c.remove();
  }

  /* A message's element; ui: {isLast, busy, streaming, specShown, reasoningOpen, compare}. */
  function message(msg, ui) {
    const m = el('div', 'msg');
    m.dataset.role = msg.role;
    m.dataset.mid = msg.mid;
    const head = el('div', 'msg-head');
    head.append(el('span', 'msg-role', msg.role === 'user' ? 'You' : msg.role === 'assistant' ? 'Assistant' : msg.role));
    const actions = el('span', 'msg-actions');
    if (msg.role === 'user') {
      actions.append(button('msg-edit', 'Edit', 'Edit this message and send it again (drops what came after it)'));
      actions.append(button('msg-copy', 'Copy', 'Copy the message'));
    } else if (msg.role === 'assistant') {
      actions.append(button('spec-toggle', 'Tokens', 'Switch between the text and the speculation view'));
      actions.append(button('compare-btn', 'Compare with no draft',
                            'Re-run this reply with the draft and without it (not saved)'));
      actions.append(button('msg-copy', 'Copy', 'Copy the reply'));
    }
    head.append(actions);
    m.append(head);
    if (msg.role === 'assistant') {
      m.append(el('div', 'msg-content markdown'));
      const view = el('div', 'spec-view');
      view.hidden = true;
      m.append(view);
      m.append(el('div', 'spec-stats'));
    } else {
      m.append(el('div', 'msg-content plain'));
    }
    update(m, msg, ui);
    return m;
  }

  /* Bring an element up to date with its message (also called for every streamed chunk). */
  function update(m, msg, ui) {
    const content = m.querySelector(':scope > .msg-content');
    if (msg.role !== 'assistant') {
      content.textContent = msg.content;
      for (const b of m.querySelectorAll('.msg-edit')) b.disabled = !!ui.busy;
      return;
    }
    const parts = splitThink(msg.content);
    const reasoning = [msg.reasoning || '', parts.reasoning].filter((s) => s.trim()).join('\n\n');
    if (reasoning) {
      const d = child(m, 'msg-reasoning', 'details', 'msg-content');
      if (!d.firstChild) {
        d.append(el('summary', 'reasoning-summary'), el('div', 'reasoning-text'));
        d.open = !!ui.reasoningOpen;
      }
      const thinking = ui.streaming && (parts.open || (!parts.reply && !msg.tool_calls));
      d.querySelector('.reasoning-summary').textContent = thinking ? 'Thinking…' : 'Reasoning';
      d.querySelector('.reasoning-text').textContent = reasoning;
    } else drop(m, 'msg-reasoning');

    if (msg.tool_calls && msg.tool_calls.length) toolCalls(child(m, 'msg-tools', 'div', 'msg-content'), msg.tool_calls);
    else drop(m, 'msg-tools');

    const text = parts.reply;
    if (content._text !== text) {
      content._text = text;
      markdown(content, text);
    }

    const note = [];
    if (ui.streaming && !text && !reasoning && !(msg.tool_calls && msg.tool_calls.length)) note.push('…');
    if (!ui.streaming && msg.stopped) note.push('(stopped)');
    if (!ui.streaming && !msg.error && !msg.stopped && !text && !reasoning && !(msg.tool_calls || []).length) {
      note.push('(empty reply)');
    }
    if (msg.finish_reason === 'length' && !ui.streaming) note.push('(max tokens reached)');
    if (note.length) child(m, 'msg-note', 'div', 'spec-view').textContent = note.join(' ');
    else drop(m, 'msg-note');

    if (msg.error) child(m, 'msg-error', 'div', 'spec-stats').textContent = msg.error;
    else drop(m, 'msg-error');

    const view = m.querySelector(':scope > .spec-view');
    const shown = !!ui.specShown;
    view.hidden = !shown;
    content.hidden = shown;
    m.classList.toggle('spec-on', shown);
    const toggle = m.querySelector('.spec-toggle');
    toggle.textContent = shown ? 'Text' : 'Tokens';
    toggle.setAttribute('aria-pressed', shown ? 'true' : 'false');
    const nTok = msg.trace ? msg.trace.tokens.length : 0;
    if (view.dataset.n !== String(nTok) || !view.firstChild) {
      if (shown || !ui.streaming) {
        view.dataset.n = String(nTok);
        Spec.renderView(view, msg.trace, parts.reply);
      }
    }

    const stats = m.querySelector(':scope > .spec-stats');
    const key = `${nTok}/${msg.trace ? msg.trace.cycles.length : 0}/${JSON.stringify(msg.timings || null)}/${!!ui.streaming}`;
    stats.hidden = !ui.streaming && !msg.timings && !(msg.trace && (msg.trace.tokens.length || msg.trace.cycles.length));
    if (stats.dataset.key !== key) {
      stats.dataset.key = key;
      Spec.renderStats(stats, msg.trace, msg.timings, ui.streaming);
    }

    const actions = m.querySelector('.msg-actions');
    const regen = actions.querySelector('.msg-regen');
    if (ui.isLast && !regen) actions.append(button('msg-regen', 'Regenerate', 'Generate this reply again'));
    else if (!ui.isLast && regen) regen.remove();
    for (const cls of ['msg-regen', 'compare-btn']) {
      const b = m.querySelector('.' + cls);
      if (b) b.disabled = !!ui.busy || !!ui.streaming || (cls === 'compare-btn' && ui.compare && ui.compare.state === 'running');
    }
    if (ui.compare) Spec.renderCompare(child(m, 'compare-result'), ui.compare);
  }

  /* The in-place editor of a user message. */
  function editor(m, text, onSend, onCancel) {
    if (m.querySelector('.msg-editor')) return;
    const content = m.querySelector(':scope > .msg-content');
    content.hidden = true;
    const box = el('div', 'msg-editor');
    const ta = el('textarea', 'msg-edit-input');
    ta.value = text;
    ta.rows = Math.min(12, Math.max(2, text.split('\n').length));
    const send = button('msg-edit-send primary', 'Send', 'Send the edited message (drops the replies after it)');
    const cancel = button('msg-edit-cancel', 'Cancel');
    const row = el('div', 'msg-editor-row');
    row.append(cancel, send);
    box.append(ta, row);
    content.after(box);
    const close = () => { box.remove(); content.hidden = false; };
    send.addEventListener('click', () => { const v = ta.value; if (!v.trim()) return; close(); onSend(v); });
    cancel.addEventListener('click', () => { close(); if (onCancel) onCancel(); });
    ta.addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); send.click(); }
      if (e.key === 'Escape') { e.preventDefault(); cancel.click(); }
    });
    ta.focus();
    ta.setSelectionRange(ta.value.length, ta.value.length);
  }

  function showDialog(d) {
    if (d.showModal) { if (!d.open) d.showModal(); } else d.setAttribute('open', '');
  }

  function closeDialog(d) {
    if (d.close && d.open) d.close();
    else d.removeAttribute('open');
  }

  return { el, button, showDialog, closeDialog, message, update, editor, splitThink, copyText, markdown, escapeHtml };
})();
