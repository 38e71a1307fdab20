// Draws every chart of the report from the JSON block embedded in the page.
// The data is parsed with JSON.parse (never eval), and untrusted strings reach the page
// only as text: chart labels were escaped when the report was written.
(function () {
  "use strict";
  var node = document.getElementById("diag-data");
  var data = JSON.parse(node.textContent);
  var config = { displaylogo: false, responsive: true,
                 modeBarButtonsToRemove: ["sendDataToCloud", "lasso2d", "select2d"] };
  (data.figures || []).forEach(function (fig) {
    var el = document.getElementById(fig.id);
    if (!el) { return; }
    try {
      Plotly.newPlot(el, fig.data, fig.layout, config);
    } catch (err) {
      el.textContent = "This chart could not be drawn: " + err;
      console.error("diag report: chart " + fig.id + " failed: " + err);
    }
  });
}());
