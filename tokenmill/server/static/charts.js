// Small charts drawn on <canvas> by hand: lines over time and a row of bars. Colours come from
// the page's CSS variables, so the charts follow the light or dark theme.

function color(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// A canvas sized to its CSS box at the screen's pixel density; returns its context and size.
function prepare(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = `11px ${getComputedStyle(canvas).fontFamily}`;
  ctx.textBaseline = "top";
  return { ctx, width, height };
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function format(value) {
  if (value === null || value === undefined) return "–";
  if (Number.isInteger(value)) return String(value);
  if (value >= 100) return value.toFixed(0);
  if (value >= 10) return value.toFixed(1);
  return value.toFixed(2);
}

// series: [{values: [number|null], color: "--css-var", label}], all sampled at the same times;
// windowSize: how many samples the x axis spans (newest at the right edge).
export function lineChart(canvas, series, windowSize, fixedMax = null) {
  const { ctx, width, height } = prepare(canvas);
  const top = 14;
  const plotHeight = height - top - 2;
  const all = series.flatMap((s) => s.values.filter((v) => v !== null));
  const max = fixedMax ?? niceMax(Math.max(0, ...all));
  ctx.strokeStyle = color("--grid");
  ctx.beginPath();
  ctx.moveTo(0, top + 0.5);
  ctx.lineTo(width, top + 0.5);
  ctx.moveTo(0, height - 1.5);
  ctx.lineTo(width, height - 1.5);
  ctx.stroke();
  ctx.fillStyle = color("--muted");
  ctx.fillText(`max ${format(max)}`, 2, 1);
  const dx = width / Math.max(1, windowSize - 1);
  let legendX = width;
  for (const s of [...series].reverse()) {
    const offset = windowSize - s.values.length;
    ctx.strokeStyle = color(s.color);
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    s.values.forEach((v, i) => {
      if (v === null) {
        drawing = false;
        return;
      }
      const x = (offset + i) * dx;
      const y = top + plotHeight * (1 - Math.min(v, max) / max);
      if (drawing) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
    const last = s.values.at(-1);
    const text = `${s.label ? `${s.label} ` : ""}${format(last)}`;
    legendX -= ctx.measureText(text).width + 8;
    ctx.fillStyle = color(s.color);
    ctx.fillText(text, legendX, 1);
  }
}

// bars: [{label, value|null}], drawn left to right with their values above them.
export function barChart(canvas, bars, barColor = "--accent") {
  const { ctx, width, height } = prepare(canvas);
  const top = 14;
  const bottom = 14;
  const max = niceMax(Math.max(0, ...bars.map((b) => b.value ?? 0)));
  const slot = width / bars.length;
  const barWidth = Math.min(48, slot * 0.6);
  bars.forEach((b, i) => {
    const x = i * slot + (slot - barWidth) / 2;
    const h = b.value === null ? 0 : (height - top - bottom) * (b.value / max);
    ctx.fillStyle = color(barColor);
    ctx.fillRect(x, height - bottom - h, barWidth, h);
    ctx.fillStyle = color("--text");
    const value = format(b.value);
    ctx.fillText(value, x + (barWidth - ctx.measureText(value).width) / 2, height - bottom - h - 12);
    ctx.fillStyle = color("--muted");
    ctx.fillText(b.label, x + (barWidth - ctx.measureText(b.label).width) / 2, height - bottom + 2);
  });
}
