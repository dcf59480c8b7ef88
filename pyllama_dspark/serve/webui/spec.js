/* Speculation made visible: the token view of a reply (what the drafter got right), its stats
 * (tok/s, tau, drafted/accepted, acceptance per block position, the schedule per cycle) and the
 * "compare with no draft" runs.  Everything reaches the DOM through textContent / attributes.
 */
'use strict';

const Spec = (() => {
  // render.js's element helper (loaded after this file; called only once the page runs)
  const el = (tag, cls, text) => Render.el(tag, cls, text);

  /* The trace's tokens as display spans: tokens whose bytes split a UTF-8 character are merged
   * (bytes accumulate until they decode); a merged span is "draft" only if all its tokens were. */
  function mergeTokens(tokens) {
    const fatal = new TextDecoder('utf-8', { fatal: true });
    const lenient = new TextDecoder('utf-8');
    const spans = [];
    let group = [];
    let bytes = [];

    function flush(text) {
      if (!group.length) return;
      spans.push({
        text: text != null ? text : lenient.decode(new Uint8Array(bytes)),
        source: group.every((t) => t.source === 'draft') ? 'draft' : 'target',
        cycle: group[0].cycle,
        pos: group[0].pos,
        toks: group,
      });
      group = [];
      bytes = [];
    }

    for (const t of tokens || []) {
      const b = Array.isArray(t.bytes) ? t.bytes : null;
      if (!b) {          // no bytes: the piece is all we have
        flush();
        group = [t];
        flush(typeof t.piece === 'string' ? t.piece : '');
        continue;
      }
      group.push(t);
      for (const x of b) bytes.push(x);
      const arr = new Uint8Array(bytes);
      let text = null;
      try {
        text = fatal.decode(arr);
      } catch (e) {
        // invalid (not just an unfinished character at the end): give up merging here
        try {
          new TextDecoder('utf-8', { fatal: true }).decode(arr, { stream: true });
        } catch (e2) {
          flush();
        }
        continue;
      }
      flush(text);
    }
    flush();
    return spans;
  }

  function spanTitle(s) {
    const src = s.source === 'draft' ? 'accepted draft' : 'target';
    const cycles = [...new Set(s.toks.map((t) => t.cycle))];
    const where = s.toks.map((t) => `${t.cycle}:${t.pos}`).join(', ');
    const ids = s.toks.map((t) => t.id).join(', ');
    return `${src} — cycle ${cycles.join(', ')} (block), pos ${s.toks.map((t) => t.pos).join(', ')}`
      + (s.toks.length > 1 ? ` [cycle:pos ${where}]` : '') + ` — token id${s.toks.length > 1 ? 's' : ''} ${ids}`;
  }

  /* Cycles of a trace, one entry per cycle number (a cycle split over chunks is summed). */
  function cyclesOf(trace) {
    const by = new Map();
    for (const c of (trace && trace.cycles) || []) {
      const old = by.get(c.cycle);
      if (old) old.tokens += c.tokens || 0;
      else by.set(c.cycle, { cycle: c.cycle, drafted: c.drafted | 0, verified: c.verified | 0,
                             accepted: c.accepted | 0, tokens: c.tokens | 0 });
    }
    return [...by.values()].sort((a, b) => a.cycle - b.cycle);
  }

  function stats(trace, timings) {
    const cycles = cyclesOf(trace).filter((c) => c.cycle > 0);
    const t = timings || {};
    const n = cycles.length;
    const sumAcc = cycles.reduce((s, c) => s + c.accepted, 0);
    const width = cycles.reduce((m, c) => Math.max(m, c.verified), 0);
    const positions = [];
    for (let p = 0; p < width; p++) positions.push({ pos: p, tried: 0, accepted: 0 });
    for (const c of cycles) {
      const tried = Math.min(c.accepted + 1, c.verified);
      for (let p = 0; p < tried; p++) positions[p].tried++;
      for (let p = 0; p < Math.min(c.accepted, c.verified); p++) positions[p].accepted++;
    }
    const num = (v) => (typeof v === 'number' && isFinite(v) ? v : null);
    return {
      tps: num(t.predicted_per_second),
      tau: n ? (sumAcc + n) / n : null,
      drafted: num(t.draft_n) != null ? t.draft_n : (n ? cycles.reduce((s, c) => s + c.verified, 0) : null),
      accepted: num(t.draft_n_accepted) != null ? t.draft_n_accepted : (n ? sumAcc : null),
      predicted: num(t.predicted_n),
      cycles,
      positions,
    };
  }

  /* The token view: a legend and one span.tok per (merged) token.  Updated in place: spans
   * already shown stay the same elements (only the last one, maybe an unfinished character,
   * is rewritten), so a view that streams keeps its nodes. */
  function renderView(box, trace, fallbackText) {
    if (!box.querySelector(':scope > .spec-legend')) {
      box.textContent = '';
      const legend = el('div', 'spec-legend');
      legend.append(el('span', 'tok-key draft', 'accepted draft token'), el('span', 'tok-key target', "target's own token"),
                    el('span', 'spec-hint', 'hover a token: cycle (block), position, token id'));
      box.append(legend, el('div', 'spec-tokens'));
    }
    const body = box.querySelector(':scope > .spec-tokens');
    const tokens = (trace && trace.tokens) || [];
    if (!tokens.length) {
      body.textContent = '';
      body.append(el('span', 'spec-empty',
                     trace && trace.dropped ? '(the token trace was dropped to save storage)'
                       : '(no token trace for this reply)'));
      if (fallbackText) body.append(el('div', 'spec-raw', fallbackText));
      return;
    }
    const spans = mergeTokens(tokens);
    let have = body.querySelectorAll(':scope > span.tok');
    if (have.length !== body.children.length || have.length > spans.length) {   // not ours: start over
      body.textContent = '';
      have = [];
    }
    spans.forEach((s, i) => {
      let sp = have[i];
      if (sp && i < have.length - 1) return;           // final already
      if (!sp) { sp = el('span'); body.append(sp); }
      sp.className = 'tok ' + s.source;
      sp.textContent = s.text;
      sp.dataset.source = s.source;
      sp.dataset.cycle = String(s.cycle);
      sp.dataset.pos = String(s.pos);
      sp.title = spanTitle(s);
      if (/^\s*$/.test(s.text) && s.text.includes('\n')) sp.classList.add('nl');
    });
  }

  const fix = (v, d) => (v == null ? '–' : Number(v).toFixed(d));

  /* Make box hold exactly n children of class cls (reusing those there). */
  function sized(box, n, cls) {
    const kids = box.querySelectorAll(':scope > .' + cls);
    if (kids.length !== box.children.length) box.textContent = '';
    while (box.children.length > n) box.lastChild.remove();
    while (box.children.length < n) box.append(el('div', cls));
    return box.children;
  }

  function statsSkeleton(box) {
    box.textContent = '';
    const row = el('div', 'stat-row');
    const stat = (label, cls, after, title) => {
      const w = el('span', 'stat');
      if (title) w.title = title;
      if (label) w.append(el('span', 'stat-label', label + ' '));
      w.append(el('span', cls, '–'));
      if (after != null) w.append(el('span', 'stat-unit ' + cls + '-unit', after));
      row.append(w);
    };
    stat('', 'stat-tps', ' tok/s', 'generation speed (timings.predicted_per_second)');
    stat('τ', 'stat-tau', null, 'mean tokens per cycle: (accepted + cycles) / cycles');
    stat('drafted', 'stat-drafted', null, 'draft tokens verified by the target (timings.draft_n)');
    stat('accepted', 'stat-accepted', '', 'draft tokens accepted (timings.draft_n_accepted)');
    stat('', 'stat-predicted', ' tokens');
    row.append(el('span', 'stat-live', 'streaming…'));
    const charts = el('div', 'stat-charts');
    const pc = el('div', 'chart');
    pc.append(el('div', 'chart-title', 'acceptance per block position'), el('div', 'pos-chart'));
    const sc = el('div', 'chart chart-wide');
    sc.append(el('div', 'chart-title', 'schedule: drafts verified per cycle (dark: accepted, grey: no draft)'),
              el('div', 'schedule-strip'));
    charts.append(pc, sc);
    box.append(row, charts);
  }

  /* Fill .spec-stats: numbers, the per-position chart and the schedule strip (in place). */
  function renderStats(box, trace, timings, live) {
    const s = stats(trace, timings);
    if (!box.querySelector('.stat-tps')) statsSkeleton(box);
    box.classList.toggle('live', !!live);
    const q = (c) => box.querySelector('.' + c);
    q('stat-tps').textContent = fix(s.tps, 1);
    q('stat-tau').textContent = fix(s.tau, 2);
    q('stat-drafted').textContent = s.drafted == null ? '–' : String(Math.round(s.drafted));
    q('stat-accepted').textContent = s.accepted == null ? '–' : String(Math.round(s.accepted));
    q('stat-accepted-unit').textContent = s.drafted ? ` (${(100 * s.accepted / s.drafted).toFixed(0)}%)` : '';
    q('stat-predicted').textContent = s.predicted == null ? '–' : String(s.predicted);
    q('stat-live').hidden = !live;

    const chart = q('pos-chart');
    const bars = sized(chart, s.positions.length, 'pos-bar');
    s.positions.forEach((p, i) => {
      const bar = bars[i];
      bar.dataset.pos = String(p.pos);
      bar.dataset.tried = String(p.tried);
      bar.dataset.accepted = String(p.accepted);
      const frac = p.tried ? p.accepted / p.tried : 0;
      bar.title = `position ${p.pos}: ${p.accepted}/${p.tried} accepted` + (p.tried ? ` (${(100 * frac).toFixed(0)}%)` : '');
      if (!bar.firstChild) bar.append(el('div', 'pos-fill'), el('span', 'pos-label', String(p.pos)));
      bar.firstChild.style.height = (100 * frac).toFixed(1) + '%';
    });
    chart.classList.toggle('empty', !s.positions.length);

    const strip = q('schedule-strip');
    const cells = sized(strip, s.cycles.length, 'sched-cell');
    const width = Math.max(1, ...s.cycles.map((c) => c.verified));
    s.cycles.forEach((c, i) => {
      const cell = cells[i];
      cell.className = 'sched-cell' + (c.verified ? '' : ' nodraft');
      cell.dataset.verified = String(c.verified);
      cell.dataset.cycle = String(c.cycle);
      cell.title = c.verified ? `cycle ${c.cycle}: verified ${c.verified}, accepted ${c.accepted}` : `cycle ${c.cycle}: no draft`;
      cell.style.height = (c.verified ? 6 + Math.round(22 * c.verified / width) : 4) + 'px';
      let acc = cell.firstChild;
      if (c.verified) {
        if (!acc) { acc = el('div', 'sched-acc'); cell.append(acc); }
        acc.style.height = (100 * Math.min(c.accepted, c.verified) / c.verified).toFixed(1) + '%';
      } else if (acc) acc.remove();
    });
    strip.classList.toggle('empty', !s.cycles.length);
  }

  /* ---- compare with no draft ------------------------------------------------------------ */

  /* Stream one request, collecting the token ids, the text and the last timings. */
  async function collect(body, signal) {
    const run = { ids: [], pieces: [], text: '', timings: null, traced: false };
    await Api.stream('/v1/chat/completions', body, {
      signal,
      onChunk(c) {
        const ch = c.choices && c.choices[0];
        if (ch && ch.delta && typeof ch.delta.content === 'string') run.text += ch.delta.content;
        if (ch && ch.delta && typeof ch.delta.reasoning_content === 'string') run.text += ch.delta.reasoning_content;
        if (c.timings) run.timings = c.timings;
        if (c.dspark_trace && Array.isArray(c.dspark_trace.tokens)) {
          run.traced = true;
          for (const t of c.dspark_trace.tokens) { run.ids.push(t.id); run.pieces.push(t.piece); }
        }
      },
    });
    return run;
  }

  /* body: the request as the reply was sent (stream, dspark_trace...); report(partial) is
   * called as the comparison advances; resolves the final result object. */
  async function compare(body, temperature, signal, report) {
    const res = { state: 'running', step: 'decoding with the draft as configured…' };
    report(res);
    const a = await collect(body, signal);
    res.draftTps = a.timings && a.timings.predicted_per_second;
    res.step = 'decoding without a draft…';
    report(res);
    const noDraft = Object.assign({}, body, { 'speculative.n_max': 0 });
    const b = await collect(noDraft, signal);
    res.nodraftTps = b.timings && b.timings.predicted_per_second;
    const byIds = a.traced && b.traced;
    const x = byIds ? a.ids : Array.from(a.text);
    const y = byIds ? b.ids : Array.from(b.text);
    let i = 0;
    while (i < x.length && i < y.length && x[i] === y[i]) i++;
    if (i === x.length && i === y.length) {
      res.verdict = `identical (${x.length} ${byIds ? 'tokens' : 'characters'})`;
    } else {
      let margin = 'n/a';
      if (byIds) {
        res.step = 'measuring the top-2 margin…';
        report(res);
        try {
          const probe = Object.assign({}, noDraft, { max_tokens: i + 1, logprobs: true, top_logprobs: 2, stream: false });
          delete probe.dspark_trace;
          delete probe.timings_per_token;
          const r = await Api.json('/v1/chat/completions', { body: probe, signal });
          const lp = r.choices && r.choices[0] && r.choices[0].logprobs;
          const at = lp && lp.content && lp.content[i];
          const top = at && at.top_logprobs;
          if (top && top.length >= 2) margin = (top[0].logprob - top[1].logprob).toFixed(4);
        } catch (e) {
          if (e && e.name === 'AbortError') throw e;
          margin = 'n/a: ' + e.message;
        }
      }
      const pa = byIds ? a.pieces[i] : x[i];
      const pb = byIds ? b.pieces[i] : y[i];
      res.verdict = `differ at token ${i} (top-2 margin ${margin})`;
      res.detail = `with draft: ${pa === undefined ? '(end)' : JSON.stringify(pa)} · without: `
        + `${pb === undefined ? '(end)' : JSON.stringify(pb)}` + (byIds ? '' : ' (compared by text: no trace)');
    }
    if (temperature > 0) {
      res.note = `temperature ${temperature} > 0: the tokens are sampled, so the texts are expected to differ.`;
    } else if (body['speculative.n_max'] === 0) {
      res.note = 'the draft is off in the settings: both runs decoded without a draft.';
    }
    if (res.draftTps && res.nodraftTps) res.speedup = res.draftTps / res.nodraftTps;
    res.state = 'done';
    delete res.step;
    report(res);
    return res;
  }

  /* Fill .compare-result from a result object (see compare). */
  function renderCompare(box, r) {
    box.textContent = '';
    box.hidden = false;
    box.dataset.state = r.state;
    const row = el('div', 'cmp-row');
    const speed = (label, cls, v) => {
      const w = el('span', 'stat');
      w.append(el('span', 'stat-label', label + ' '), el('span', cls, v == null ? '–' : Number(v).toFixed(1)),
               el('span', 'stat-unit', ' tok/s'));
      row.append(w);
    };
    speed('with draft', 'cmp-draft-tps', r.draftTps);
    speed('no draft', 'cmp-nodraft-tps', r.nodraftTps);
    if (r.speedup) row.append(el('span', 'cmp-speedup', `×${r.speedup.toFixed(2)}`));
    box.append(el('div', 'cmp-title', 'Compare with no draft'), row);
    if (r.step) box.append(el('div', 'cmp-step', r.step));
    if (r.verdict != null) {
      const v = el('div', 'cmp-verdict', r.verdict);
      v.classList.add(r.verdict.startsWith('identical') ? 'same' : 'diff');
      box.append(v);
    }
    if (r.detail) box.append(el('div', 'cmp-detail', r.detail));
    if (r.note) box.append(el('div', 'cmp-note', r.note));
    if (r.error) box.append(el('div', 'cmp-error', r.error));
  }

  return { mergeTokens, stats, cyclesOf, renderView, renderStats, compare, renderCompare };
})();
