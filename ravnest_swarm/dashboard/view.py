"""Rendering a :class:`SwarmState` as one rich renderable: title, totals, swarm map, spares, loss curve, events.

Every line is laid out for the width it is given and never folded: cells and event lines are cut with
an ellipsis instead, and clusters that do not fit side by side wrap into further rows of columns, so
the dashboard stays readable from 80 columns up, with 30 peers or more. A large run (``focus.py``: more
than 64 peers, or a snapshot holding only part of the run) shows the run's summary, one row of the
clusters that matter to the viewer and one line for the rest.
"""

from __future__ import annotations

import io
import time
from typing import Dict, List, Optional, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from ravnest_swarm.dashboard.focus import Focus, focus, is_large, run_figures
from ravnest_swarm.dashboard.state import Event, SwarmState
from ravnest_swarm.membership.progress import placed_use

STATE_STYLES = {"training": "green", "averaging": "cyan", "standby": "yellow", "joining": "magenta",
                "leaving": "red"}
STATE_SHORT = {"training": "train", "averaging": "avg", "standby": "spare", "joining": "join", "leaving": "bye"}
EVENT_STYLES = {"start": "dim", "joined": "green", "left": "red", "replaced": "yellow", "round": "bold cyan",
                "avg-fail": "bold red", "rejected": "bold magenta",
                "diverged": "bold red"}
BLOCKS = " ▁▂▃▄▅▆▇█"
MIN_CELL, MAX_CELL = 17, 24  # a cell's third line ("#12.3k 123/s 2.31") needs 17 columns
STAGE_LABEL = 3  # "s12"
LOSS_ROWS = 3
MIN_EVENT_LINES, MAX_EVENT_LINES = 3, 8


def render(state: SwarmState, width: int, height: Optional[int] = None, me: Optional[str] = None) -> RenderableType:
    """The whole dashboard for a terminal ``width`` columns wide.

    :param state: the swarm to show
    :param width: columns to lay out for (80 and up stays tidy)
    :param height: terminal rows; when given, map cells drop to two lines and the event log shrinks as
        far as needed to keep everything on screen
    :param me: this volunteer's name, highlighted in the map (and in a large run, its cluster and neighbours shown)
    """
    large = is_large(state)
    head = [_title(state, width), _run_totals(state, width) if large else _totals(state, width)]
    # one row of the clusters that matter in a large run
    shown = focus(state, me, _per_row(state.clusters(), width)) if large else None
    spares = _spares(state, width, max_lines=1 if large else None)

    def layout(compact: bool, loss_rows: int) -> List[RenderableType]:
        return head + _swarm_map(state, width, me, compact, shown) + spares + _loss_curve(state, width, loss_rows)

    parts = layout(False, LOSS_ROWS)
    event_lines = MAX_EVENT_LINES
    if height is not None:
        rows = height - 1 - 1  # Live keeps the terminal's last row free; the event log has a rule
        # shorter and shorter: two-line cells, then a one-row loss curve
        for compact, loss_rows in ((True, LOSS_ROWS), (True, 1)):
            if _height(parts, width) + MIN_EVENT_LINES <= rows:
                break
            parts = layout(compact, loss_rows)
        event_lines = max(MIN_EVENT_LINES, min(MAX_EVENT_LINES, rows - _height(parts, width)))
    parts += _events(state, width, event_lines)
    return Group(*parts)


def render_text(state: SwarmState, width: int = 80, me: Optional[str] = None) -> str:
    """The dashboard as plain text, ``width`` columns wide (for tests and logs)."""
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None, legacy_windows=False)
    console.print(render(state, width, me=me))
    return console.export_text()


def _title(state: SwarmState, width: int) -> Text:
    seen = "no snapshot yet" if state.at is None else time.strftime("%H:%M:%S", time.localtime(state.at))
    title = Text(f"ravnest-swarm · run {state.run or '?'}", style="bold")
    if state.finished:
        # its length, or, where its owner ended it sooner (an open-ended run always), the step its stages reached
        reached = [p.get("step") or 0 for p in state.peers if p.get("cluster") is not None and p["cluster"] >= 0]
        title.append(f" · finished at step {max(reached) if reached else state.steps}", style="bold green")
    title.append(f" · {seen}", style="dim")
    title.truncate(width, overflow="ellipsis")
    return title


def _totals(state: SwarmState, width: int) -> Text:
    totals = state.totals()
    running = f", {totals.averaging_running} averaging now" if totals.averaging_running else ""
    items = [
        f"peers {totals.peers}",
        f"clusters {totals.clusters}",
        f"placed {totals.placed}",
        f"spares {totals.standby}",
        f"{_rate(totals.samples_per_s)} samples/s",
        f"avg rounds {totals.averaging_done} done, {totals.averaging_failures} failed{running}",
        f"plan round {'-' if totals.plan_round is None else totals.plan_round}",
    ] + _use(state) + _refused(state)
    return _pack(items, width, " │ ")


def _use(state: SwarmState) -> List[str]:
    """The placed stages' mean utilisation and the traffic of the peers read, added up, where their records say."""
    utilisation = (placed_use(state.peers) or {}).get("utilisation")
    up, down = (sum(p.get(field) or 0.0 for p in state.peers) for field in ("bytes_up_per_s", "bytes_down_per_s"))
    return ([] if utilisation is None else [f"busy {utilisation:.0%}"]) + \
        ([f"up {_bytes(up)}/s down {_bytes(down)}/s"] if up or down else [])


def _bytes(value: float) -> str:
    return next(f"{value / scale:.1f} {unit}" for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
                if value >= scale or unit == "B")


def _refused(state: SwarmState) -> List[str]:
    """What the observer's own validator refused (records written by a key that is not the peer they name...)."""
    total = sum(state.refused.values())
    return [f"refused {total} record{'s' if total != 1 else ''}"] if total else []


def _run_totals(state: SwarmState, width: int) -> Text:
    """A large run's totals: peers by state and clusters from its summary, and how many records this view read."""
    figures, totals = run_figures(state), state.totals()
    by_state = ", ".join(f"{count} {STATE_SHORT.get(name, name)}"
                         for name, count in sorted(figures.states.items(), key=lambda item: -item[1]))
    items = [f"peers {figures.peers} ({by_state})" if by_state else f"peers {figures.peers}",
             f"clusters {figures.clusters}",
             f"{_rate(figures.samples_per_s)} samples/s",
             f"avg rounds {totals.averaging_done} done, {totals.averaging_failures} failed",
             f"plan round {'-' if totals.plan_round is None else totals.plan_round}"] + _use(state) + _refused(state)
    if figures.read < figures.peers:
        items.append(f"{figures.read} records read")
    return _pack(items, width, " │ ")


def _pack(items: Sequence[str], width: int, separator: str, max_lines: Optional[int] = None) -> Text:
    """Items on as few lines as fit ``width``, never splitting one; with ``max_lines``, those that do not fit in
    them are counted at the end (``, 12 more``)."""
    lines, line = [], ""
    for index, item in enumerate(items):
        candidate = item if not line else line + separator + item
        if line and len(candidate) > width:
            if max_lines is not None and len(lines) + 1 == max_lines:
                more = f"{separator}{len(items) - index} more"
                while line and len(line) + len(more) > width and separator in line:
                    line, index = line.rsplit(separator, 1)[0], index - 1
                    more = f"{separator}{len(items) - index} more"
                line += more
                break
            lines.append(line)
            candidate = item
        line = candidate
    lines.append(line)
    return Text("\n".join(lines), no_wrap=True, overflow="ellipsis")


def _swarm_map(state: SwarmState, width: int, me: Optional[str], compact: bool,
               shown: Optional[Focus] = None) -> List[RenderableType]:
    """Every cluster, or in a large run the ``shown`` ones and a line for the rest."""
    clusters = state.clusters()
    title = "swarm map: clusters → columns, stages ↓ rows"
    drawn = clusters
    if shown is not None and clusters:
        drawn = {k: clusters[k] for k in shown.shown}
        title = (f"swarm map: {len(drawn)} of {len(drawn) + shown.hidden} clusters "
                 "(yours, neighbours, failing, slowest)")
    parts: List[RenderableType] = [Rule(title, style="dim")]
    if not clusters:
        parts.append(Text("no cluster yet: waiting for a planning round (the first opens once --min-peers peers, "
                          "2 by default, are live)", style="dim"))
    for chunk, cell_width in _chunks(drawn, width):
        parts.append(_cluster_table(state, {k: drawn[k] for k in chunk}, cell_width, me, compact))
    if shown is not None and shown.hidden:
        parts.append(_more_clusters(shown, width))
    return parts


def _more_clusters(shown: Focus, width: int) -> Text:
    """One line for the clusters the map leaves out: how many, the failing ones and the slowest of them."""
    named = [f"c{k} {down} slot(s) down" for k, down in shown.failing]
    named += [f"c{k} {_rate(rate)}/s" for k, rate in shown.slowest]
    items = [f"{shown.hidden} more clusters"]
    if named:
        items = [f"{items[0]}, failing and slowest first: {named[0]}"] + named[1:]
    return _pack(items, width, ", ", max_lines=1)


def _per_row(clusters: Dict[int, Dict[int, List[Dict]]], width: int) -> int:
    """How many clusters fit side by side at ``width`` with the longest name of ``clusters`` whole."""
    longest = max((len(p["name"]) for stages in clusters.values() for holders in stages.values() for p in holders),
                  default=MIN_CELL)
    wanted = min(MAX_CELL, max(MIN_CELL, longest))
    # a column costs its cell, a divider and a column of padding, except that the table's last column has
    # no padding; the stage label column comes first
    return max(1, (width - STAGE_LABEL + 1) // (wanted + 2))


def _chunks(clusters: Dict[int, Dict[int, List[Dict]]], width: int):
    """Groups of clusters shown side by side, as even as possible, and the cell width for each group."""
    per_row = _per_row(clusters, width)
    keys = list(clusters)
    if not keys:
        return
    rows = -(-len(keys) // per_row)
    start = 0
    for row in range(rows):
        # balanced rows: 7 clusters at 3 a row go 3 + 2 + 2, not 3 + 3 + 1
        size = len(keys) // rows + (row < len(keys) % rows)
        chunk, start = keys[start:start + size], start + size
        cell = min(MAX_CELL, max(MIN_CELL, (width - STAGE_LABEL + 1) // len(chunk) - 2))
        yield chunk, cell


def _cluster_table(state: SwarmState, clusters: Dict[int, Dict[int, List[Dict]]], cell_width: int,
                   me: Optional[str], compact: bool) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), expand=False)
    table.add_column("", width=STAGE_LABEL, no_wrap=True, style="dim")
    for cluster, stages in clusters.items():
        rate = state.cluster_samples_per_s(stages)
        header = Text(f"cluster {cluster}", style="bold")
        if rate is not None and len(f"cluster {cluster} {_rate(rate)}/s") <= cell_width:
            header.append(f" {_rate(rate)}/s", style="dim")
        table.add_column(header, width=cell_width, no_wrap=True, overflow="ellipsis")
    depth = max(max(stages, default=0) for stages in clusters.values()) + 1
    for stage in range(depth):
        cells = [_cell(state, (cluster, stage), stages.get(stage), cell_width, me, compact)
                 for cluster, stages in clusters.items()]
        table.add_row(Text(f"s{stage}"), *cells)
    return table


def _cell(state: SwarmState, slot, holders: Optional[List[Dict]], width: int, me: Optional[str],
          compact: bool) -> Text:
    """A peer in three lines (name; state and layers; step, samples/s, loss).

    Compact cells take two lines and drop step and samples/s: the stages of one pipeline run at about
    the same rate, which the cluster's header shows.
    """
    if holders is None:
        return Text("")
    if not holders:
        planned = state.planned_peer(slot)
        if planned is not None and planned[1] is not None:
            # placed by the plan, alive, not serving the slot yet (fetching its layers, or its record lags)
            short = STATE_SHORT.get(planned[1]["state"], planned[1]["state"])
            return _lines([(planned[0], "dim bold"), (f"starting (now {short})", "dim")], width)
        return _lines([("(vacant)", "red"), (f"plan: {planned[0]}" if planned else "", "dim")], width)
    peer = holders[0]
    style = STATE_STYLES.get(peer["state"], "")
    name_style = f"bold {style} reverse" if peer["name"] == me else f"bold {style}"
    layers = "-" if peer.get("layers") is None else f"{peer['layers'][0]}-{peer['layers'][1]}"
    step = "-" if peer.get("step") is None else _count(peer["step"])
    rate = "-" if peer.get("samples_per_s") is None else _rate(peer["samples_per_s"])
    loss = "" if peer.get("loss") is None else f" {_loss(peer['loss'])}"
    short = STATE_SHORT.get(peer["state"], peer["state"])
    if compact:
        lines = [(peer["name"], name_style), (f"{short} L{layers}{loss}", style)]
    else:
        busy = "" if peer.get("utilisation") is None else f" {peer['utilisation']:.0%}"
        lines = [(peer["name"], name_style), (f"{short} L{layers}{_memory(peer)}", style),
                 (f"#{step} {rate}/s{loss}{busy}", "")]
    if len(holders) > 1:
        lines.append((f"+ {', '.join(p['name'] for p in holders[1:])}", "dim"))
    return _lines(lines, width)


def _lines(lines, width: int) -> Text:
    """Lines of a cell, each cut to ``width`` with an ellipsis (a cell never folds)."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for index, (line, style) in enumerate(lines):
        part = Text(line, style=style)
        part.truncate(width, overflow="ellipsis")
        if index:
            text.append("\n")
        text.append_text(part)
    return text


def _spares(state: SwarmState, width: int, max_lines: Optional[int] = None) -> List[RenderableType]:
    unplaced = state.unplaced()
    if not unplaced:
        return []
    items = [f"{p['name']} ({STATE_SHORT.get(p['state'], p['state'])})" for p in unplaced]
    items[0] = f"outside clusters ({len(unplaced)}): {items[0]}"
    return [_pack(items, width, ", ", max_lines)]


def _loss_curve(state: SwarmState, width: int, rows: int = LOSS_ROWS) -> List[RenderableType]:
    """The curve in ``rows`` rows of blocks with the highest and lowest point, and a caption; in one row, the
    last value is its label and there is no caption."""
    parts: List[RenderableType] = [Rule("loss (mean over training peers)", style="dim")]
    values = [loss for _, loss in state.losses]
    if not values:
        return parts + [Text("no loss reported yet", style="dim")]
    low, high = min(values), max(values)
    label = max(len(_loss(high)), len(_loss(low)), 5)
    columns = max(8, width - label - 1)
    points = _resample(values, columns)
    # a short history is stretched (up to 4 columns a point) so that its slope stays visible
    points = [v for v in points for _ in range(max(1, min(4, columns // len(points))))]
    span = (high - low) or 1.0
    levels = [round((v - low) / span * (rows * 8 - 1)) + 1 for v in points]  # 1..rows*8 eighths
    lines = []
    for row in range(rows - 1, -1, -1):
        bar = "".join(BLOCKS[min(8, max(0, level - row * 8))] for level in levels)
        axis = _loss(high) if row == rows - 1 else _loss(low) if row == 0 and high > low else ""
        if rows == 1:
            axis = _loss(values[-1])
        lines.append(Text(f"{axis:>{label}} ", style="dim") + Text(bar, style="green"))
    if rows == 1:
        return parts + lines
    caption = Text(f"{'':>{label}} last {_loss(values[-1])} over {len(values)} snapshot(s)", style="dim",
                   no_wrap=True, overflow="ellipsis")
    return parts + [Text("\n").join(lines), caption]


def _resample(values: List[float], columns: int) -> List[float]:
    """At most ``columns`` points: bucket means when there are more values than columns."""
    if len(values) <= columns:
        return values
    buckets = [values[i * len(values) // columns:(i + 1) * len(values) // columns] for i in range(columns)]
    return [sum(b) / len(b) for b in buckets if b]


def _events(state: SwarmState, width: int, count: int) -> List[RenderableType]:
    parts: List[RenderableType] = [Rule("events", style="dim")]
    events: List[Event] = list(state.events)[-count:]
    if not events:
        return parts + [Text("none yet", style="dim")]
    for event in events:
        line = Text(time.strftime("%H:%M:%S ", time.localtime(event.at)), style="dim")
        line.append(f"{event.kind:<8} ", style=EVENT_STYLES.get(event.kind, ""))
        line.append(event.text)
        line.truncate(width, overflow="ellipsis")
        parts.append(line)
    return parts


def _height(renderables: List[RenderableType], width: int) -> int:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    return len(console.render_lines(Group(*renderables), console.options.update(width=width), pad=False))


def _memory(peer: Dict) -> str:
    """`` 310M`` (the process's measured peak), or for a GPU peer `` gpu2.1G`` (the GPU's peak allocation)."""
    if peer.get("device_peak_gb") is not None:
        return f" gpu{_gigabytes(peer['device_peak_gb'])}"
    return "" if peer.get("peak_memory_gb") is None else f" {_gigabytes(peer['peak_memory_gb'])}"


def _gigabytes(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.0f}M"
    return f"{value:.1f}G" if value < 10 else f"{value:.0f}G"


def _count(value: int) -> str:
    if value < 10_000:
        return str(value)
    if value < 10_000_000:
        return f"{value / 1000:.1f}k" if value < 100_000 else f"{value // 1000}k"
    return f"{value / 1_000_000:.1f}M"


def _rate(value: float) -> str:
    if value < 10:
        return f"{value:.1f}"
    return f"{value:.0f}" if value < 10_000 else f"{value / 1000:.0f}k"


def _loss(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"
