// Live refresh: every element with data-refresh="URL" is replaced, every data-interval-ms,
// by the HTML fragment the server renders at URL (same origin, the session cookie). No other
// script runs on the console's pages; the CSP refuses inline script.
"use strict";
(function () {
  function poll(el) {
    var url = el.getAttribute("data-refresh");
    var every = parseInt(el.getAttribute("data-interval-ms"), 10) || 2000;
    function tick() {
      fetch(url, {credentials: "same-origin", cache: "no-store"})
        .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
        .then(function (html) { el.innerHTML = html; el.setAttribute("data-refreshed", Date.now()); })
        .catch(function () { el.setAttribute("data-refresh-failed", Date.now()); })
        .then(function () { setTimeout(tick, every); });
    }
    setTimeout(tick, every);
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(poll);
  });
})();
