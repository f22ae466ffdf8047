// Takes over the server-rendered page: polls /ui/state once a second and redraws the tables and
// the memory chart. The page calls its data stale when the gateway's sample time stops moving or
// the poll fails, so a frozen number is never shown as live.
(function () {
  "use strict";
  var main = document.querySelector("main");
  var status = document.getElementById("status");
  var lastSampled = 0, lastChange = Date.now();
  var STALE_MS = 5000;

  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function secs(v) {
    if (v === null || v === undefined) return "\u2013";
    return v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(2) + " s";
  }
  function gib(v) { return (v / 1073741824).toFixed(2) + " GiB"; }
  function rows(tableId, items, cells, emptyText) {
    var table = document.getElementById(tableId);
    if (!table) return;
    var body = table.tBodies[0];
    while (body.firstChild) body.removeChild(body.firstChild);
    if (!items.length) {
      var tr = el("tr"); var td = el("td", emptyText); td.colSpan = table.tHead.rows[0].cells.length;
      tr.appendChild(td); body.appendChild(tr); return;
    }
    items.forEach(function (item) {
      var tr = el("tr");
      cells(item).forEach(function (c) {
        var td = el("td", c.text, c.cls);
        tr.appendChild(td);
      });
      if (item.name) tr.setAttribute("data-lane", item.name);
      body.appendChild(tr);
    });
  }
  function table(id, headers) {
    var t = el("table"); t.id = id;
    var h = t.createTHead().insertRow();
    headers.forEach(function (x) { h.appendChild(el("th", x)); });
    t.appendChild(document.createElement("tbody"));
    return t;
  }
  function drawLanes(s) {
    rows("lanes", s.lanes, function (l) {
      return [
        { text: l.name + (l.yielding ? " (yielding)" : "") },
        { text: l.policy },
        { text: l.inflight + "/" + l.max_inflight, cls: "inflight" + (l.inflight >= l.max_inflight ? " hot" : "") },
        { text: l.queued + "/" + l.max_queue, cls: "queued" + (l.max_queue && l.queued >= l.max_queue ? " hot" : "") },
        { text: l.rate_429.toFixed(2), cls: "r429" + (l.rate_429 > 0 ? " hot" : "") },
        { text: l.rate_503.toFixed(2), cls: "r503" + (l.rate_503 > 0 ? " hot" : "") },
        { text: l.total_429, cls: "t429" },
        { text: l.total_503, cls: "t503" },
        { text: secs(l.queue_wait_p50_seconds), cls: "p50" },
        { text: secs(l.queue_wait_p99_seconds), cls: "p99" },
        { text: l.waiting_for ? l.waiting_for.text : "", cls: "waiting" + (l.waiting_for && l.waiting_for.pool ? " hot" : "") }
      ];
    }, "no lanes");
  }
  function drawMemory(s) {
    var devices = Object.keys(s.memory_used_bytes).map(function (k) {
      return { device: k, used: s.memory_used_bytes[k] };
    });
    var names = s.pool_names || {};
    rows("memory", devices, function (d) {
      return [{ text: names[d.device] || "GPU " + d.device }, { text: gib(d.used) }];
    }, "no memory probe");
    var box = document.getElementById("box");
    while (box.firstChild) box.removeChild(box.firstChild);
    var b = s.extras && s.extras.box;
    if (b && b.enforce) {
      var e = b.enforce;
      var p = el("p", "limit " + gib(e.limit_bytes) + " enforced by memory cgroup " + e.version +
        " " + e.cgroup + ": in use " + gib(e.working_set_bytes) + " (charged " + gib(e.usage_bytes) +
        "), OOM kills " + e.oom_kills);
      p.id = "enforce";
      box.appendChild(p);
    }
    if (b && b.backends) {
      box.appendChild(el("h3", "Backends"));
      var t = table("backends", ["backend", "role", "state", "memory now", "measured idle", "peak", "restarts", "last exit"]);
      box.appendChild(t);
      rows("backends", b.backends, function (x) {
        return [{ text: x.name }, { text: x.role }, { text: x.state },
                { text: x.current_bytes == null ? "\u2013" : gib(x.current_bytes), cls: "now" },
                { text: x.resident_bytes == null ? "\u2013" : gib(x.resident_bytes) },
                { text: x.peak_bytes == null ? "\u2013" : gib(x.peak_bytes) },
                { text: x.restarts },
                { text: x.last_exit || "\u2013" }];
      }, "no backends");
    }
    var ledger = document.getElementById("ledger");
    while (ledger.firstChild) ledger.removeChild(ledger.firstChild);
    var pools = s.ledger || [];
    if (pools.length) {
      ledger.appendChild(el("h3", "Memory ledger"));
      var lt = table("ledger-table", ["pool", "total", "free (read)", "reserved", "reservations", "reading age"]);
      ledger.appendChild(lt);
      rows("ledger-table", pools, function (d) {
        return [{ text: d.name || d.kind + " " + d.device },
                { text: d.total_bytes == null ? "\u2013" : gib(d.total_bytes) },
                { text: d.free_bytes == null ? "\u2013" : gib(d.free_bytes) },
                { text: gib(d.reserved_bytes || 0), cls: "reserved" },
                { text: d.reservations || 0, cls: "reservations" },
                { text: d.reading_age_seconds == null ? "none" : d.reading_age_seconds.toFixed(1) + " s" }];
      }, "no pools");
    }
    drawChart(s.memory_history);
  }
  function drawChart(points) {
    var svg = document.getElementById("chart");
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    if (!points || points.length < 2) return;
    // Ten minutes at most; a younger gateway's history fills the width.
    var t1 = points[points.length - 1].unix_ms;
    var t0 = Math.max(t1 - 600000, points[0].unix_ms);
    var span = Math.max(t1 - t0, 1);
    var max = 0;
    points.forEach(function (p) { if (p.used_bytes > max) max = p.used_bytes; });
    if (max <= 0) max = 1;
    var pts = points.filter(function (p) { return p.unix_ms >= t0; }).map(function (p) {
      var x = ((p.unix_ms - t0) / span) * 600;
      var y = 115 - (p.used_bytes / max) * 110;
      return x.toFixed(1) + "," + y.toFixed(1);
    }).join(" ");
    var line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", pts);
    svg.appendChild(line);
    var label = document.createElementNS("http://www.w3.org/2000/svg", "text");
    label.setAttribute("x", "4"); label.setAttribute("y", "12"); label.setAttribute("font-size", "10");
    label.textContent = "peak " + gib(max) + ", last " + Math.max(1, Math.round(span / 60000)) + " min";
    svg.appendChild(label);
  }
  function drawEngines(s) {
    rows("engines", s.engines, function (e) {
      return [{ text: e.upstream },
              { text: e.kv_cache_usage == null ? "\u2013" : Math.round(e.kv_cache_usage * 100) + " %" },
              { text: e.running == null ? "\u2013" : e.running },
              { text: e.waiting == null ? "\u2013" : e.waiting }];
    }, "no engine metrics");
  }
  function drawRejections(s) {
    rows("rejections", s.rejections, function (r) {
      return [{ text: r.lane }, { text: r.code, cls: "code" }, { text: r.status },
              { text: r.last_minute, cls: "minute" }, { text: r.total, cls: "total" }];
    }, "no rejections");
  }
  function setStatus(text, cls) {
    status.textContent = text;
    status.className = "status " + cls;
    main.setAttribute("data-state", cls);
  }
  function poll() {
    fetch("ui/state", { cache: "no-store", credentials: "same-origin" }).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.json();
    }).then(function (s) {
      if (s.sampled_unix_ms !== lastSampled) { lastSampled = s.sampled_unix_ms; lastChange = Date.now(); }
      main.setAttribute("data-sampled", String(s.sampled_unix_ms));
      drawLanes(s); drawMemory(s); drawEngines(s); drawRejections(s);
      var stale = s.sampled_unix_ms === 0 || Date.now() - lastChange > STALE_MS;
      var when = s.sampled_unix_ms ? new Date(s.sampled_unix_ms).toLocaleTimeString() : "never";
      setStatus((stale ? "stale: last sample " : "live: sampled ") + when +
                (s.draining ? " (draining)" : ""), stale ? "stale" : "live");
    }).catch(function (e) {
      setStatus("stale: " + e.message, "stale");
    });
  }
  poll();
  setInterval(poll, 1000);
})();
