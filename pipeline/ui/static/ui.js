// causalmem ui: keyboard shortcuts on the queue page, the lease release on leaving it,
// and the health page's polling. Plain JavaScript, no build step, nothing fetched from elsewhere.
(function () {
  "use strict";

  function labelingPage(form) {
    const rows = Array.from(form.querySelectorAll("tr[data-slot]"));
    const history = [];  // marks, newest last, for "undo"
    const rating = document.getElementById("rating");
    const shown = document.getElementById("rating-shown");
    let waitingForRating = false;
    let submitting = false;

    function paint(row) {
      const correct = row.querySelector("input[name=correct]").checked;
      const harmful = row.querySelector("input[name=harmful]").checked;
      row.classList.toggle("mark-correct", correct);
      row.classList.toggle("mark-harmful", harmful);
    }
    function toggle(row, which) {
      const box = row.querySelector("input[name=" + which + "]");
      const other = row.querySelector("input[name=" + (which === "correct" ? "harmful" : "correct") + "]");
      history.push({ row: row, correct: row.querySelector("input[name=correct]").checked,
                     harmful: row.querySelector("input[name=harmful]").checked });
      box.checked = !box.checked;
      if (box.checked) other.checked = false;  // a memory is correct or harmful, not both
      paint(row);
    }
    function setRating(r) {
      history.push({ rating: rating.value });
      rating.value = r ? String(r) : "";
      shown.textContent = r ? "rating " + r : "no rating";
      form.querySelectorAll("button.rate").forEach(function (b) { b.classList.toggle("on", b.dataset.rating === String(r)); });
    }
    function undo() {
      const last = history.pop();
      if (!last) return;
      if (last.row) {
        last.row.querySelector("input[name=correct]").checked = last.correct;
        last.row.querySelector("input[name=harmful]").checked = last.harmful;
        paint(last.row);
      } else {
        const r = last.rating;
        rating.value = r; shown.textContent = r ? "rating " + r : "no rating";
        form.querySelectorAll("button.rate").forEach(function (b) { b.classList.toggle("on", b.dataset.rating === r); });
      }
    }
    function send(action) {
      if (submitting) return;  // one submit per sample: a second Enter sends nothing
      submitting = true;
      const button = document.getElementById(action === "skip" ? "skip" : "send");
      form.requestSubmit(button);
    }
    rows.forEach(function (row) {
      row.querySelectorAll("input[type=checkbox]").forEach(function (box) {
        box.addEventListener("change", function () {
          const other = row.querySelector("input[name=" + (box.name === "correct" ? "harmful" : "correct") + "]");
          if (box.checked) other.checked = false;
          paint(row);
        });
      });
    });
    form.querySelectorAll("button.rate").forEach(function (b) {
      b.addEventListener("click", function () { setRating(Number(b.dataset.rating)); });
    });
    document.getElementById("undo").addEventListener("click", undo);
    form.addEventListener("submit", function () { submitting = true; });

    document.addEventListener("keydown", function (e) {
      const t = e.target;
      if (t && (t.tagName === "INPUT" && t.type !== "checkbox" || t.tagName === "TEXTAREA" || t.tagName === "SELECT")) {
        if (e.key === "Escape") t.blur();
        return;  // typing a skip reason
      }
      if (e.ctrlKey || e.metaKey || e.altKey) return;
      const digit = /^Digit([0-9])$/.exec(e.code || "");
      if (digit) {
        const n = Number(digit[1]);
        if (waitingForRating) {
          waitingForRating = false;
          if (n >= 1 && n <= 5) setRating(n);
        } else if (n >= 1 && n <= rows.length) {
          toggle(rows[n - 1], e.shiftKey ? "harmful" : "correct");
        }
        e.preventDefault();
        return;
      }
      waitingForRating = false;
      switch (e.key) {
        case "r": waitingForRating = true; e.preventDefault(); break;
        case "u": undo(); e.preventDefault(); break;
        case "s": send("skip"); e.preventDefault(); break;
        case "Enter": send("answer"); e.preventDefault(); break;
        case "Escape": document.getElementById("leave-form").submit(); e.preventDefault(); break;
      }
    });

    // Leaving the page any other way releases the lease too (a beacon survives the unload).
    window.addEventListener("pagehide", function () {
      if (submitting) return;
      const data = new FormData(document.getElementById("leave-form"));
      data.append("beacon", "1");
      navigator.sendBeacon("/queue/leave", data);
    });
  }

  function livePart(box) {
    const every = Number(box.dataset.every) || 5000;
    setInterval(function () {
      fetch(box.dataset.live, { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) { if (html !== null) box.innerHTML = html; })
        .catch(function () { /* keep the last view */ });
    }, every);
  }

  document.addEventListener("keydown", function (e) {
    const t = e.target;
    if (e.key !== "z" || e.ctrlKey || e.metaKey || e.altKey || (t && t.tagName === "INPUT" && t.type !== "checkbox")) return;
    const held = document.getElementById("undo-form");
    if (held) { held.submit(); e.preventDefault(); }
  });

  document.addEventListener("DOMContentLoaded", function () {
    const form = document.getElementById("label-form");
    if (form) labelingPage(form);
    const live = document.querySelector("[data-live]");
    if (live) livePart(live);
  });
})();
