// Live refresh: every element with data-refresh="URL" is replaced, every data-interval-ms,
// by the HTML fragment the server renders at URL (same origin, the session cookie). No other
// script runs on the console's pages; the CSP refuses inline script.
"use strict";
(function () {
  function poll(el) {
    var url = el.getAttribute("data-refresh");
    var every = parseInt(el.getAttribute("data-interval-ms"), 10) || 2000;
    var last = null;
    function tick() {
      fetch(url, {credentials: "same-origin", cache: "no-store"})
        .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
        .then(function (html) {
          // only when it changed: an unchanged fragment keeps its elements (a button about to
          // be clicked, a selection), and a changed one replaces them
          if (html !== last) { el.innerHTML = html; last = html; }
          el.setAttribute("data-refreshed", Date.now());
        })
        .catch(function () { el.setAttribute("data-refresh-failed", Date.now()); })
        .then(function () { setTimeout(tick, every); });
    }
    setTimeout(tick, every);
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(poll);
  });
})();
