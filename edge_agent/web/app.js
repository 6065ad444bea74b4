// coe-edge status page. Live through server-sent events (/api/stream), polling /api/status when a
// stream cannot be held. Everything is drawn from one status document; text from frames (ids, boards,
// reasons) only ever goes in through textContent, never as HTML.
"use strict";

(function () {
  const token = new URLSearchParams(location.search).get("token");
  const withToken = (path) => token ? path + (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token) : path;
  const $ = (id) => document.getElementById(id);
  const BUCKETS = ["1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128-255"];
  const COLORS = { load: "#4aa8ff", evict: "#ff9f43", admit: "#34d17a", grid: "#1e2935", text: "#8a99a8",
                   line: "#8a99a8", in: "#4aa8ff", out: "#34d17a" };
  let lastUpdate = 0;
  let lastDoc = null;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  const fmtInt = (n) => (n === null || n === undefined) ? "–" : Number(n).toLocaleString("en-US");
  const fmtRate = (x) => (x === null || x === undefined) ? "–" : (x >= 100 ? x.toFixed(0) : x.toFixed(1));
  const fmtMs = (x) => (x === null || x === undefined) ? "–" : (x >= 100 ? x.toFixed(0) : x.toFixed(1));
  // a latency as [number, unit]: milliseconds below 10 s, seconds above, so the tile never overflows
  const latency = (ms) => (ms !== null && ms !== undefined && ms >= 10000) ? [(ms / 1000).toFixed(1), "s"] : [fmtMs(ms), "ms"];
  function fmtBytes(n) {
    if (n >= 1e9) return (n / 1e9).toFixed(2) + " GB";
    if (n >= 1e6) return (n / 1e6).toFixed(1) + " MB";
    if (n >= 1e3) return (n / 1e3).toFixed(0) + " kB";
    return n + " B";
  }
  function fmtTime(t) {
    const d = new Date(t * 1000);
    return d.toLocaleTimeString("en-GB", { hour12: false });
  }
  function replaceRows(table, rows, emptyText) {
    table.replaceChildren();
    if (!rows.length) {
      const tr = el("tr", "none");
      tr.appendChild(el("td", null, emptyText));
      table.appendChild(tr);
      return;
    }
    for (const [k, v, cls] of rows) {
      const tr = el("tr", cls || "");
      tr.appendChild(el("th", null, k));
      tr.appendChild(el("td", v > 0 && cls === "bad" ? "bad" : "", fmtInt(v)));
      table.appendChild(tr);
    }
  }
  function sizeCanvas(c) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(10, c.clientWidth), h = Math.max(10, c.clientHeight);
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const ctx = c.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return [ctx, w, h];
  }

  // -- header -------------------------------------------------------------------------------
  function renderHealth(doc) {
    const h = doc.health, badge = $("health");
    badge.textContent = h.ready ? "READY" : "NOT READY";
    badge.className = "badge " + (h.ready ? "ok" : "bad");
    const why = [...h.reasons, ...h.warnings];
    $("health-why").textContent = why.join(" · ");
    $("line").textContent = doc.line;
    document.title = (h.ready ? "" : "NOT READY · ") + "line " + doc.line + " · coe-edge";
  }

  // -- KPIs ---------------------------------------------------------------------------------
  function spark(canvas, series, color) {
    const [ctx, w, h] = sizeCanvas(canvas);
    if (!series || series.length < 2) return;
    const max = Math.max(1, ...series);
    ctx.beginPath();
    series.forEach((v, i) => {
      const x = (i / (series.length - 1)) * w, y = h - 2 - (v / max) * (h - 4);
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.stroke();
    ctx.lineTo(w, h);
    ctx.lineTo(0, h);
    ctx.closePath();
    ctx.globalAlpha = 0.15;
    ctx.fillStyle = color;
    ctx.fill();
    ctx.globalAlpha = 1;
  }
  function kpi(id, text, unit) {
    $(id).querySelector(".num").textContent = text;
    if (unit !== undefined) $(id).querySelector("small").textContent = unit;
  }
  function renderKpis(doc) {
    const f = doc.flow, lat = doc.latency, hist = doc.history;
    kpi("k-line", fmtRate(f.line_rate));
    kpi("k-in", fmtRate(f.in_rate));
    kpi("k-out", fmtRate(f.out_rate));
    spark($("k-line").querySelector("canvas"), hist.line, COLORS.line);
    spark($("k-in").querySelector("canvas"), hist.in, COLORS.in);
    spark($("k-out").querySelector("canvas"), hist.out, COLORS.out);
    kpi("k-p50", ...latency(lat.p50_ms));
    kpi("k-p99", ...latency(lat.p99_ms));
    $("k-lat-n").textContent = lat.count ? fmtInt(lat.count) + " verdicts in the last " + lat.window_s + " s" : "no verdicts in the last minute";
    $("k-lat-max").textContent = lat.max_ms !== null ? "max " + latency(lat.max_ms).join(" ") : "";
    const v = f.verdicts, total = (v.pass || 0) + (v.defect || 0) + (v.error || 0);
    kpi("k-defects", fmtInt(v.defect || 0));
    $("k-defect-share").textContent = total ? ((100 * (v.defect || 0)) / total).toFixed(1) + "% of " + fmtInt(total) : "";
    $("k-verdicts").textContent = "pass " + fmtInt(v.pass || 0) + " · error " + fmtInt(v.error || 0);
  }

  // -- frames, executors, errors --------------------------------------------------------
  function renderFrames(doc) {
    const f = doc.flow;
    $("c-received").textContent = fmtInt(f.received);
    $("c-accepted").textContent = fmtInt(f.accepted);
    $("c-duplicate").textContent = fmtInt(f.duplicate);
    $("c-inflight").textContent = fmtInt(f.inflight);
    const rej = Object.assign({ busy: 0 }, f.rejected);
    const rows = Object.entries(rej).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]))
      .map(([k, n]) => [k, n, k === "busy" ? "busy" : "bad"]);
    replaceRows($("rejects"), rows, "none");
  }
  function renderExecutors(doc) {
    const box = $("executors");
    box.replaceChildren();
    for (const e of doc.executors) {
      const card = el("div", "exec");
      const name = el("div", "name", e.name);
      name.appendChild(el("small", null, e.device));
      card.appendChild(name);
      const q = el("div", "q", fmtInt(e.queued));
      q.appendChild(el("small", null, "queued"));
      card.appendChild(q);
      card.appendChild(el("div", "meta", e.batches
        ? fmtInt(e.batches) + " batches · mean " + e.mean_batch + " · max " + e.max_batch + " · last " + e.last_batch
        : "no batches in the last minute"));
      const hist = el("div", "hist");
      const counts = e.batch_sizes || {};
      let top = 4;
      BUCKETS.forEach((b, i) => { if (counts[b]) top = Math.max(top, i); });
      const max = Math.max(1, ...Object.values(counts));
      BUCKETS.slice(0, top + 1).forEach((b) => {
        const bar = el("div", "b");
        bar.style.height = Math.max(2, (34 * (counts[b] || 0)) / max) + "px";
        bar.title = "batch size " + b + ": " + (counts[b] || 0);
        bar.appendChild(el("span", null, b));
        hist.appendChild(bar);
      });
      card.appendChild(hist);
      card.appendChild(el("div", "hist-pad"));
      box.appendChild(card);
    }
  }
  function renderErrors(doc) {
    const rows = Object.entries(doc.errors).map(([k, n]) => [k, n, k === "reject:busy" ? "busy" : "bad"]);
    replaceRows($("errors"), rows, "none");
    const llm = doc.llm;
    $("p-llm").hidden = !llm;
    if (llm) {
      $("llm-model").textContent = llm.model || "";
      $("llm-tps").textContent = fmtRate(llm.tokens_per_s);
      $("llm-res").textContent = fmtInt(llm.resident) + " / " + fmtInt(llm.experts);
      $("llm-bytes").textContent = fmtBytes(llm.resident_bytes) + " of LLM experts resident · " + fmtInt(llm.tokens) + " tokens since start";
    }
  }

  // -- boxes (a line whose executors run on other boxes too) ----------------------------------
  function renderCluster(doc) {
    const c = doc.cluster;
    $("p-cluster").hidden = !c;
    if (!c) return;
    $("cluster-address").textContent = c.address ? "ray " + c.address : "";
    const nodes = $("cluster-nodes").tBodies[0];
    nodes.replaceChildren();
    for (const [name, n] of Object.entries(c.nodes || {}).sort()) {
      const tr = el("tr", n.alive ? "up" : "down");
      tr.dataset.node = name;
      tr.appendChild(el("td", "name", name));
      tr.appendChild(el("td", "health", n.alive ? "alive" : "dead"));
      tr.appendChild(el("td", "mono", n.address || "–"));
      tr.appendChild(el("td", null, n.cpus === undefined ? "–" : String(n.cpus)));
      tr.appendChild(el("td", null, n.gpus === undefined ? "–" : String(n.gpus)));
      nodes.appendChild(tr);
    }
    const execs = $("cluster-executors").tBodies[0];
    execs.replaceChildren();
    for (const e of c.executors || []) {
      const tr = el("tr", e.up ? "up" : "down");
      tr.dataset.executor = e.name;
      tr.appendChild(el("td", "name", e.name));
      tr.appendChild(el("td", null, e.node));
      tr.appendChild(el("td", null, e.device));
      tr.appendChild(el("td", "state", String(e.state)));
      tr.appendChild(el("td", null, fmtBytes(e.resident_bytes) + " of " + fmtBytes(e.capacity)));
      tr.appendChild(el("td", null, e.batches === undefined ? "–" : fmtInt(e.batches)));
      tr.appendChild(el("td", null, e.lost === undefined ? "–" : fmtInt(e.lost)));
      tr.appendChild(el("td", null, e.requeued === undefined ? "–" : fmtInt(e.requeued)));
      const holds = el("td", "holds");
      const shown = (e.resident || []).slice(0, 12);
      for (const x of shown) holds.appendChild(el("span", "chip resident", x));
      if ((e.resident || []).length > shown.length) holds.appendChild(el("span", "chip more", "+" + (e.resident.length - shown.length) + " more"));
      tr.appendChild(holds);
      execs.appendChild(tr);
    }
  }

  // -- memory tiers ---------------------------------------------------------------------------
  function renderPools(doc) {
    const box = $("pools");
    box.replaceChildren();
    for (const p of doc.pools) {
      const card = el("div", "pool");
      card.dataset.pool = p.name;
      const head = el("div", "head");
      head.appendChild(el("b", null, p.name));
      head.appendChild(el("span", "tier", p.tier + " tier · " + p.residents.length + " resident"));
      const hit = el("span", "hit", p.hit_rate === null ? "–" : (100 * p.hit_rate).toFixed(1) + "%");
      hit.appendChild(el("small", null, " hit rate"));
      head.appendChild(hit);
      card.appendChild(head);
      const used = p.capacity ? p.resident_bytes / p.capacity : 0;
      const meter = el("div", "meter" + (used > 0.95 ? " full" : ""));
      const fill = el("div");
      fill.style.width = Math.min(100, 100 * used).toFixed(1) + "%";
      meter.appendChild(fill);
      card.appendChild(meter);
      const bytes = el("div", "bytes");
      bytes.appendChild(el("span", null, fmtBytes(p.resident_bytes) + " of " + fmtBytes(p.capacity)));
      bytes.appendChild(el("span", null, fmtInt(p.hits) + " hits · " + fmtInt(p.misses) + " loads · " + fmtInt(p.evictions) + " evictions"
        + (p.declined ? " · " + fmtInt(p.declined) + " declined" : "")));   // victims a ranked host tier turned away
      card.appendChild(bytes);
      const chips = el("div", "chips");
      const shown = p.residents.slice(0, 48);
      for (const r of shown) {
        const chip = el("span", "chip resident" + (r.llm ? " llm" : "") + (r.pinned ? " pinned" : ""), r.expert_id);
        chip.title = r.expert_id + " · " + fmtBytes(r.nbytes) + (r.pinned ? " · in use" : "") + (r.llm ? " · LLM" : "");
        chips.appendChild(chip);
      }
      if (p.residents.length > shown.length) chips.appendChild(el("span", "chip more", "+" + (p.residents.length - shown.length) + " more"));
      card.appendChild(chips);
      box.appendChild(card);
    }
  }
  function renderTimeline(doc) {
    const c = $("timeline");
    const names = doc.pools.map((p) => p.name);
    c.style.height = Math.max(60, 26 * names.length + 22) + "px";
    const [ctx, w, h] = sizeCanvas(c);
    const left = 84, span = 120, now = doc.at, rowH = (h - 18) / Math.max(1, names.length);
    ctx.font = "12px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    names.forEach((n, i) => {
      const y = 4 + rowH * i;
      ctx.fillStyle = COLORS.text;
      ctx.fillText(n, 8, y + rowH / 2);
      ctx.fillStyle = COLORS.grid;
      ctx.fillRect(left, y + rowH / 2, w - left - 8, 1);
    });
    for (let s = 0; s <= span; s += 30) {
      const x = left + ((span - s) / span) * (w - left - 8);
      ctx.fillStyle = COLORS.grid;
      ctx.fillRect(x, 2, 1, h - 18);
      ctx.fillStyle = COLORS.text;
      ctx.textAlign = s ? (s === span ? "start" : "center") : "end";
      ctx.fillText(s ? "-" + s + " s" : "now", x, h - 8);
      ctx.textAlign = "start";
    }
    for (const e of doc.timeline) {
      const i = names.indexOf(e.pool), age = now - e.at;
      if (i < 0 || age > span || age < -1) continue;
      const x = left + ((span - Math.max(0, age)) / span) * (w - left - 8), y = 4 + rowH * i;
      ctx.fillStyle = COLORS[e.event] || COLORS.text;
      if (e.event === "evict") ctx.fillRect(x - 1.5, y + rowH / 2 + 1, 3, rowH / 2 - 3);
      else ctx.fillRect(x - 1.5, y + 2, 3, rowH / 2 - 3);
    }
  }

  // -- defects ---------------------------------------------------------------------------------
  const cards = new Map();
  function stepText(s) {
    const o = s.output || {};
    let said;
    if (o.label !== undefined) said = o.label + " " + Number(o.score).toFixed(2);
    else if (o.boxes) said = o.boxes.length ? o.boxes.length + " box" + (o.boxes.length > 1 ? "es" : "") + ": " + o.boxes.map((b) => b[5]).slice(0, 3).join(", ") : "no boxes";
    else said = "?";
    return [s.expert_id, said, s.version === null || s.version === undefined ? "" : "v" + s.version];
  }
  function defectLabel(d) {
    // what the deciding step said: a classifier's label, or a detector's box classes; else the stored reason
    const o = (d.steps.length && d.steps[d.steps.length - 1].output) || {};
    if (o.label !== undefined) return o.label.replace(/_/g, " ");
    if (o.boxes && o.boxes.length) return [...new Set(o.boxes.map((b) => String(b[5]).replace(/_/g, " ")))].join(", ");
    return d.reason || "defect";
  }
  function defectCard(d) {
    const card = el("div", "defect");
    card.dataset.frame = d.frame_id;
    if (d.thumbnail) {
      const img = el("img", "thumb");
      img.alt = "frame " + d.frame_id;
      img.width = 96;
      img.height = 96;
      img.src = withToken("/api/frames/" + encodeURIComponent(d.frame_id) + "/thumbnail");
      card.appendChild(img);
    } else {
      card.appendChild(el("div", "noimg", "no image"));
    }
    const body = el("div");
    body.appendChild(el("div", "what", defectLabel(d)));
    const where = el("div", "where");
    where.appendChild(document.createTextNode(d.component + " "));
    where.appendChild(el("span", null, "board " + d.board_id));
    body.appendChild(where);
    const chain = el("div", "chain");
    d.steps.forEach((s, i) => {
      const [who, said, ver] = stepText(s);
      chain.appendChild(document.createTextNode((i ? "→ " : "") + who + ": " + said + " "));
      if (ver) chain.appendChild(el("span", "v", ver + " "));
    });
    body.appendChild(chain);
    const when = el("div", "when", fmtTime(d.decided_at) + " · " + d.frame_id + " · ");
    const link = el("a", null, "details");
    link.href = withToken("/api/frames/" + encodeURIComponent(d.frame_id));
    link.target = "_blank";
    link.rel = "noopener";
    when.appendChild(link);
    body.appendChild(when);
    card.appendChild(body);
    return card;
  }
  function renderDefects(doc) {
    const box = $("defects");
    if (!doc.defects.length) {
      if (!box.querySelector(".none")) box.replaceChildren(el("div", "none", "no defects yet"));
      return;
    }
    const keep = new Set(doc.defects.map((d) => d.frame_id));
    for (const id of [...cards.keys()]) if (!keep.has(id)) cards.delete(id);
    const nodes = doc.defects.map((d) => {
      if (!cards.has(d.frame_id)) cards.set(d.frame_id, defectCard(d));
      return cards.get(d.frame_id);
    });
    box.replaceChildren(...nodes);
  }

  // -- wiring ---------------------------------------------------------------------------------
  function render(doc) {
    lastDoc = doc;
    lastUpdate = Date.now();
    renderHealth(doc);
    renderKpis(doc);
    renderFrames(doc);
    renderExecutors(doc);
    renderErrors(doc);
    renderPools(doc);
    renderTimeline(doc);
    renderCluster(doc);
    renderDefects(doc);
    setConn("live", "live");
  }
  function setConn(cls, text) {
    $("conn").className = "conn " + cls;
    $("conn-text").textContent = text;
  }
  let polling = false;
  function poll() {
    polling = true;
    fetch(withToken("/api/status"), { cache: "no-store" })
      .then((r) => r.ok ? r.json() : Promise.reject(new Error("HTTP " + r.status)))
      .then(render)
      .catch(() => setConn("stale", "reconnecting"))
      .finally(() => setTimeout(poll, 2000));
  }
  function connect() {
    if (!window.EventSource) { poll(); return; }
    let failures = 0;
    const es = new EventSource(withToken("/api/stream"));
    es.onmessage = (ev) => { failures = 0; render(JSON.parse(ev.data)); };
    es.onerror = () => {
      failures += 1;
      setConn("stale", "reconnecting");
      // CLOSED: the browser gave up for good (an answer that is not a stream, e.g. the 503 when every stream slot
      // is taken) and fires no further error; 5 failures: a proxy that buffers streams.  Either way, poll instead.
      if (es.readyState === EventSource.CLOSED || failures >= 5) {
        es.close();
        if (!polling) poll();
      }
    };
  }
  setInterval(() => {
    $("clock").textContent = new Date().toLocaleTimeString("en-GB", { hour12: false });
    if (lastUpdate && Date.now() - lastUpdate > 5000) setConn("stale", "no update for " + Math.round((Date.now() - lastUpdate) / 1000) + " s");
  }, 1000);
  window.addEventListener("resize", () => { if (lastDoc) { renderKpis(lastDoc); renderTimeline(lastDoc); } });
  connect();
})();
