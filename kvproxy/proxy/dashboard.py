"""``GET /kvproxy/dashboard``: a dependency-free HTML page over /kvproxy/health and
/kvproxy/stats (refreshes every 2 s; reads the window without resetting it)."""

DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvproxy</title>
<style>
body{font:14px system-ui,sans-serif;margin:2em;color:#222}
h1{font-size:1.3em} table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
td.v{text-align:right;font-variant-numeric:tabular-nums}
.warn{color:#a40} .ok{color:#070}
</style></head><body>
<h1>kvproxy <span id="status"></span></h1>
<div id="warnings"></div>
<h2>Fleet</h2><table id="fleet"></table>
<h2>Stats (current window)</h2><table id="stats"></table>
<script>
function rows(table, obj){
  table.innerHTML = Object.entries(obj).map(([k,v]) =>
    `<tr><td>${k}</td><td class="v">${typeof v === "number" ? +v.toFixed(4) : JSON.stringify(v)}</td></tr>`).join("");
}
async function tick(){
  try{
    const h = await (await fetch("/kvproxy/health")).json();
    const s = await (await fetch("/kvproxy/stats")).json();
    const st = document.getElementById("status");
    st.textContent = h.status; st.className = h.status === "ok" ? "ok" : "warn";
    document.getElementById("warnings").innerHTML =
      (h.warnings || []).map(w => `<p class="warn">${w}</p>`).join("");
    rows(document.getElementById("fleet"), {
      router_reachable: h.router_reachable, engines_known: h.engines_known,
      engines_healthy: h.engines_healthy, session_lifecycle: h.features.session_lifecycle,
      admission: h.features.admission});
    rows(document.getElementById("stats"), s);
  }catch(e){ document.getElementById("status").textContent = "unreachable"; }
}
tick(); setInterval(tick, 2000);
</script></body></html>
"""
