// Colour scales for token boxes. Every colour is light (HSL lightness >= 72%) under #111 text,
// so the text keeps a contrast ratio above 4.5:1 (WCAG AA) whatever the value.

// Probability 0 -> red, 0.5 -> yellow, 1 -> green.
export function probabilityColour(p) {
  if (p === null || p === undefined || Number.isNaN(p)) return "#e5e7eb";
  const x = Math.max(0, Math.min(1, p));
  return `hsl(${Math.round(x * 120)}, 75%, ${Math.round(78 + 4 * Math.abs(x - 0.5))}%)`;
}

// Diverging: -1 blue, 0 near white, +1 orange-red (value already scaled to [-1, 1]).
export function divergingColour(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "#e5e7eb";
  const x = Math.max(-1, Math.min(1, v));
  const hue = x < 0 ? 215 : 20;
  return `hsl(${hue}, 85%, ${Math.round(97 - 25 * Math.abs(x))}%)`;
}

function swatch(text, colour) {
  const s = document.createElement("span");
  s.className = "swatch";
  s.style.background = colour;
  s.textContent = text;
  return s;
}

export function renderLegend(element, mode, maxAbs) {
  element.replaceChildren();
  const title = document.createElement("span");
  title.className = "title";
  if (mode === "readout") {
    title.textContent = "Projection:";
    element.append(title);
    for (const v of [-1, -0.5, 0, 0.5, 1]) {
      element.append(swatch((v * maxAbs).toFixed(2), divergingColour(v)));
    }
  } else {
    title.textContent = "Probability:";
    element.append(title);
    for (const p of [0, 0.1, 0.25, 0.5, 0.75, 0.9, 1]) element.append(swatch(p.toFixed(2), probabilityColour(p)));
    element.append(swatch("not scored", probabilityColour(null)));
    const note = document.createElement("span");
    note.className = "muted";
    note.textContent = "· underlined: prompt";
    element.append(note);
  }
}
