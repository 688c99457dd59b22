"""Charts drawn on the server as SVG: no script draws them, and nothing comes from outside.

Only numbers and escaped labels reach the markup; colours come from the console's stylesheet
through class names (the CSP allows no inline style).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from markupsafe import Markup

W, H = 640, 200
LEFT, RIGHT, TOP, BOTTOM = 44, 12, 14, 46
METRICS = (("ledger_success_rate", "success"), ("feedback_success_rate", "feedback"))


def _x(i: int, n: int) -> float:
    span = W - LEFT - RIGHT
    return LEFT + (span * (i + 0.5) / n if n else 0)


def _y(rate: float) -> float:
    return TOP + (H - TOP - BOTTOM) * (1 - rate)


def _line(points: Sequence[tuple[float, float]], cls: str) -> str:
    if not points:
        return ""
    d = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    dots = "".join(f'<circle class="{cls}" cx="{x:.1f}" cy="{y:.1f}" r="3"/>' for x, y in points)
    return f'<polyline class="{cls}" fill="none" points="{d}"/>{dots}'


def windows_chart(windows: Sequence[dict[str, Any]], metric: str, title: str) -> Markup:
    """One metric per window, canary (target) against stable (baseline), 0-100 %, with each
    window's identity mismatches and decision written under it."""
    n = len(windows)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {W} {H}" '
             f'role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>']
    for pct in (0, 50, 100):
        y = _y(pct / 100)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" '
                     f'y2="{y:.1f}"/><text class="axis" x="{LEFT - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{pct}%</text>')
    for arm, cls in (("baseline", "stable"), ("target", "canary")):  # canary on top, dashed
        pts = [(_x(i, n), _y(float(w[arm][metric])))
               for i, w in enumerate(windows) if w.get(arm, {}).get(metric) is not None]
        parts.append(_line(pts, cls))
    for i, w in enumerate(windows):
        x = _x(i, n)
        mism = int(w.get("target", {}).get("identity_mismatches") or 0)
        decision = str(w.get("decision", ""))
        parts.append(f'<text class="axis" x="{x:.1f}" y="{H - BOTTOM + 14}" '
                     f'text-anchor="middle">{escape(str(w.get("percent", "")))}%</text>')
        parts.append(f'<text class="decision d-{escape(decision)}" x="{x:.1f}" '
                     f'y="{H - BOTTOM + 28}" text-anchor="middle">{escape(decision[:9])}</text>')
        if mism:
            parts.append(f'<text class="mismatch" x="{x:.1f}" y="{H - BOTTOM + 41}" '
                         f'text-anchor="middle">{mism} mism</text>')
    if not n:
        parts.append(f'<text class="axis" x="{W / 2}" y="{H / 2}" text-anchor="middle">'
                     "no window judged yet</text>")
    parts.append(f'<text class="legend canary-t" x="{W - RIGHT}" y="{TOP}" text-anchor="end">'
                 'canary</text><text class="legend stable-t" x="{0}" y="{1}" '
                 'text-anchor="end">stable</text>'.format(W - RIGHT - 56, TOP))
    parts.append("</svg>")
    return Markup("".join(parts))  # every interpolated string above was escaped


def rollout_charts(windows: Sequence[dict[str, Any]]) -> list[Markup]:
    return [windows_chart(windows, key, f"{label} rate per window: canary against stable")
            for key, label in METRICS]
