// Charts from the data-chart attributes the server rendered, and the "live" toggle: while on, the page's
// <main> is fetched again every 5 s and swapped in (the server renders it; no client-side state).
(function () {
  "use strict";
  const COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c"];
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];  // whole steps only

  function drawCharts(root) {
    root.querySelectorAll("figure.chart").forEach(function (fig) {
      const spec = JSON.parse(fig.dataset.chart);
      fig.querySelectorAll(".uplot").forEach(function (old) { old.remove(); });
      const data = [spec.steps].concat(spec.series.map(function (s) { return s.values; }));
      const series = [{ label: "step" }].concat(spec.series.map(function (s, i) {
        return { label: s.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
                 points: { show: true, size: 6 } };
      }));
      new uPlot({ width: Math.max(fig.clientWidth - 16, 300), height: 200, series: series,
                  scales: { x: { time: false } }, axes: [{ label: "learner step", incrs: STEP_INCRS }, {}] }, data, fig);
    });
  }

  const LIVE_KEY = "harnessrl-live";
  let timer = null;
  async function refresh() {
    const response = await fetch(window.location.href, { headers: { "Accept": "text/html" } });
    if (!response.ok) { return; }
    const doc = new DOMParser().parseFromString(await response.text(), "text/html");
    const main = document.querySelector("main");
    main.innerHTML = doc.querySelector("main").innerHTML;
    drawCharts(main);
  }
  function setLive(on) {
    if (timer) { clearInterval(timer); timer = null; }
    if (on) { timer = setInterval(refresh, 5000); }
  }

  document.addEventListener("DOMContentLoaded", function () {
    drawCharts(document);
    const toggle = document.getElementById("live-toggle");
    const livePage = document.body.dataset.live === "1";
    toggle.disabled = !livePage;
    toggle.checked = livePage && localStorage.getItem(LIVE_KEY) !== "0";
    toggle.addEventListener("change", function () {  // the choice is remembered for the live pages
      localStorage.setItem(LIVE_KEY, toggle.checked ? "1" : "0");
      setLive(toggle.checked);
    });
    setLive(toggle.checked);
  });
})();
