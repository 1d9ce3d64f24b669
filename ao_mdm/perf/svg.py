"""A plain SVG line plot (no plotting library): what the benchmarks draw their curves with."""

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def line_plot(curves: dict[str, list[tuple[float, float]]], x_label: str, y_label: str) -> str:
  """Each named curve of (x, y) points on shared axes, labelled at their ends and ticks."""
  w, h, pad = 480, 300, 44
  points = [p for c in curves.values() for p in c] or [(0.0, 0.0)]
  x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
  y0, y1 = min(0.0, *(p[1] for p in points)), max(p[1] for p in points)
  x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
  x = lambda v: pad + (w - 2 * pad) * (v - x0) / (x1 - x0)
  y = lambda v: h - pad - (h - 2 * pad) * (v - y0) / (y1 - y0)
  parts = [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="11">',
    f'<rect width="{w}" height="{h}" fill="white"/>',
    f'<line x1="{pad}" y1="{y(y0)}" x2="{w - pad}" y2="{y(y0)}" stroke="black"/>',
    f'<line x1="{pad}" y1="{y(y0)}" x2="{pad}" y2="{y(y1)}" stroke="black"/>',
    f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">{x_label}</text>',
    f'<text x="4" y="{pad - 14}">{y_label}</text>',
  ]
  for v in (y0, (y0 + y1) / 2, y1):
    parts.append(f'<text x="{pad - 4}" y="{y(v) + 4}" text-anchor="end">{v:.3g}</text>')
  for v in (x0, (x0 + x1) / 2, x1):
    parts.append(f'<text x="{x(v)}" y="{y(y0) + 14}" text-anchor="middle">{v:.4g}</text>')
  for k, (name, curve) in enumerate(curves.items()):
    colour = COLOURS[k % len(COLOURS)]
    line = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in curve)
    parts.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"/>')
    label = f'<text x="{w - pad}" y="{pad + 14 * k}" fill="{colour}" text-anchor="end">'
    parts.append(f"{label}{name}</text>")
  return "\n".join([*parts, "</svg>", ""])
