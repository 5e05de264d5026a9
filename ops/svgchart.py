"""Line charts as standalone SVG, with the standard library only (the benchmark's plots).

A chart is a row of panels sharing one legend; each panel has linear axes from zero with
rounded ticks, one line per series, and optionally a dashed horizontal threshold (an SLO).
Text is escaped: labels come from the command line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final
from xml.sax.saxutils import escape, quoteattr

PANEL_W: Final = 420
PANEL_H: Final = 300
MARGIN_L: Final = 64
MARGIN_R: Final = 16
MARGIN_T: Final = 40
MARGIN_B: Final = 48
LEGEND_H: Final = 28
# Colour-blind-safe (Okabe and Ito), one per series in order.
COLOURS: Final = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")


@dataclass(frozen=True, slots=True)
class Series:
    """A named line: (x, y) points, drawn in x order; points with a missing y are left out."""

    label: str
    points: Sequence[tuple[float, float | None]]


@dataclass(frozen=True, slots=True)
class Panel:
    """One plot of the row."""

    title: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    threshold: float | None = None  # a dashed horizontal line, e.g. the SLO's bound
    threshold_label: str = ""
    notes: Sequence[str] = field(default=())


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """Ticks from 0 to at least `high` at a step of 1, 2 or 5 times a power of ten."""
    if not high > 0 or math.isinf(high):
        return [0.0, 1.0]
    raw = high / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    n = math.ceil(high / step - 1e-9)
    return [round(i * step, 12) for i in range(n + 1)]


def _num(value: float) -> str:
    return f"{value:g}"


def _panel(panel: Panel, left: float, top: float) -> list[str]:
    plot_w = PANEL_W - MARGIN_L - MARGIN_R
    plot_h = PANEL_H - MARGIN_T - MARGIN_B
    xs = [x for s in panel.series for x, y in s.points if y is not None]
    ys = [y for s in panel.series for _, y in s.points if y is not None]
    if panel.threshold is not None:
        ys.append(panel.threshold)
    x_ticks = nice_ticks(max(xs, default=1.0))
    y_ticks = nice_ticks(max(ys, default=1.0) * 1.05)
    x_max, y_max = x_ticks[-1], y_ticks[-1]
    x0, y0 = left + MARGIN_L, top + MARGIN_T

    def px(x: float) -> float:
        return x0 + plot_w * x / x_max

    def py(y: float) -> float:
        return y0 + plot_h * (1 - y / y_max)

    out = [
        f'<text x="{x0 + plot_w / 2:.1f}" y="{top + 22}" text-anchor="middle" '
        f'font-size="14" font-weight="bold">{escape(panel.title)}</text>',
        f'<rect x="{x0}" y="{y0}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>',
    ]
    base = y0 + plot_h
    for t in x_ticks:
        out.append(f'<line x1="{px(t):.1f}" y1="{base}" x2="{px(t):.1f}" y2="{base + 4}" stroke="#888"/>')
        out.append(
            f'<text x="{px(t):.1f}" y="{base + 16}" text-anchor="middle" font-size="11">{_num(t)}</text>'
        )
    for t in y_ticks:
        out.append(f'<line x1="{x0}" y1="{py(t):.1f}" x2="{x0 + plot_w}" y2="{py(t):.1f}" stroke="#eee"/>')
        out.append(
            f'<text x="{x0 - 6}" y="{py(t) + 4:.1f}" text-anchor="end" font-size="11">{_num(t)}</text>'
        )
    out.append(
        f'<text x="{x0 + plot_w / 2:.1f}" y="{top + PANEL_H - 10}" text-anchor="middle" '
        f'font-size="12">{escape(panel.x_label)}</text>'
    )
    mid = y0 + plot_h / 2
    out.append(
        f'<text x="{left + 16}" y="{mid:.1f}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 {left + 16} {mid:.1f})">{escape(panel.y_label)}</text>'
    )
    if panel.threshold is not None:
        ty = py(panel.threshold)
        out.append(
            f'<line class="threshold" x1="{x0}" y1="{ty:.1f}" x2="{x0 + plot_w}" y2="{ty:.1f}" '
            'stroke="#666" stroke-dasharray="6 4"/>'
        )
        if panel.threshold_label:
            out.append(
                f'<text x="{x0 + plot_w - 4}" y="{ty - 4:.1f}" text-anchor="end" font-size="11" '
                f'fill="#666">{escape(panel.threshold_label)}</text>'
            )
    for i, series in enumerate(panel.series):
        colour = COLOURS[i % len(COLOURS)]
        points = sorted((x, y) for x, y in series.points if y is not None)
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        if len(points) > 1:
            out.append(
                f'<polyline data-series={quoteattr(series.label)} points="{coords}" '
                f'fill="none" stroke="{colour}" stroke-width="2"/>'
            )
        for x, y in points:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>')
    return out


def line_chart(panels: Sequence[Panel], *, title: str = "") -> str:
    """The panels side by side, a legend of every series below them, as one SVG document."""
    width = PANEL_W * max(1, len(panels))
    top = 30 if title else 0
    height = top + PANEL_H + LEGEND_H
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Verdana, sans-serif">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    if title:
        out.append(f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="15">{escape(title)}</text>')
    for i, panel in enumerate(panels):
        out += _panel(panel, i * PANEL_W, top)
    labels = list(dict.fromkeys(s.label for p in panels for s in p.series))
    x = MARGIN_L
    for i, label in enumerate(labels):
        colour = COLOURS[i % len(COLOURS)]
        y = top + PANEL_H + LEGEND_H / 2
        out.append(f'<line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" stroke="{colour}" stroke-width="3"/>')
        out.append(f'<text x="{x + 30}" y="{y + 4}" font-size="12">{escape(label)}</text>')
        x += 48 + 8 * len(label)
    out.append("</svg>")
    return "\n".join(out) + "\n"
