"""``ravnest-swarm export``: the run's trained model out of the swarm, or out of a ``local`` run's checkpoints.

From a live swarm (:func:`export_run`), a DHT client reads the run's signed spec, the adopted plan and every peer
record, and downloads each layer as a stage filling its layers does: over ``swarm.state_transfer.fill_layer``,
which asks the holders the plan names first, reaches each over the route a stage would (direct, connection reversal,
a backbone's forwarding), and believes a layer only when two holders serve the same averaged copy where two or more
count (the only holder's live weights otherwise). It works mid-run (each layer as its holders serve it now) and
after the run finished, while holders remain. A layer nobody serves, or whose holders disagree or fail, ends the
export with one line naming it; nothing is left half-written.

The export is written layer by layer (``checkpoint.SafetensorsWriter``: the header comes from the spec's layout,
so each layer's tensors go to disk as they arrive): a process holds about one layer at a time, never the model.
What an export holds and how it is used: ``swarm/exported.py``.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
from safetensors import SafetensorError, safe_open

from ravnest_swarm.checkpoint import SafetensorsWriter, first_non_finite, write_atomically
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import ModelSpec
from ravnest_swarm.swarm.exported import FORMAT, MANIFEST, WEIGHTS, layer_prefixes, weight_entries

TRANSFER_TIMEOUT = 120.0  # seconds one holder may take to send one layer


@dataclass
class ExportOptions:
    """What ``export`` reads and where it writes.

    :param initial_peers: backbones' multiaddrs
    :param run: the run's address, ``name@owner`` (a bare name trusts the only owner it finds)
    :param out: the directory to write ``model.safetensors`` and ``model.json`` to (created)
    :param timeout: seconds to wait for the initial peers and for each DHT read
    :param transfer_timeout: seconds one holder may take to send one layer
    """

    initial_peers: List[str]
    run: str
    out: str
    timeout: float = 15.0
    transfer_timeout: float = TRANSFER_TIMEOUT


def check_export_dir(out: str, flag: str) -> Optional[str]:
    """Where an export goes: a directory, or a path where one can be made (``flag`` names the option in the line).
    Returns the run of an export already there, which the new one replaces once whole (an export of the run made
    again is its newer copy); a ``model.json`` or ``model.safetensors`` there that is not an export is someone's
    file, never overwritten: a one-line :class:`UserError`."""
    if not out:
        raise UserError(f"{flag} is empty: name the directory the export goes to", 2)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{flag} {out} is a file, not a directory", 1)
    # tried now, not after the download or training whose result it would keep; and undone, so an export refused
    # later (a run nobody serves) leaves nothing behind: the writer makes it
    missing = os.path.abspath(out)
    while not os.path.exists(os.path.dirname(missing)) and os.path.dirname(missing) != missing:
        missing = os.path.dirname(missing)
    made = not os.path.exists(missing)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {out}: cannot make the directory ({e.strerror or e})", 1)
    writable = os.access(out, os.W_OK | os.X_OK)
    if made:  # the directories just made, deepest first, each only while empty (another process may write there)
        made_dir = os.path.abspath(out)
        while True:
            try:
                os.rmdir(made_dir)
            except OSError:
                break
            if made_dir == missing:
                break
            made_dir = os.path.dirname(made_dir)
    if not writable:
        raise UserError(f"{flag} {out}: this user cannot write there", 1)
    manifest_path, weights_path = os.path.join(out, MANIFEST), os.path.join(out, WEIGHTS)
    if not (os.path.lexists(manifest_path) or os.path.lexists(weights_path)):
        return None
    formats, run = [], None
    try:
        if os.path.lexists(manifest_path):
            with open(manifest_path) as file:
                manifest = json.load(file)
            formats.append(manifest.get("format"))
            run = manifest.get("run")
        if os.path.lexists(weights_path):
            with safe_open(weights_path, "pt") as weights:
                metadata = weights.metadata() or {}
            formats.append(metadata.get("format"))
            run = run or metadata.get("run")
    except (OSError, ValueError, AttributeError, SafetensorError) as e:
        formats.append(f"unreadable ({e})")
    if any(found != FORMAT for found in formats):
        raise UserError(f"{flag} {out} holds a {MANIFEST} or {WEIGHTS} that is not a ravnest export: choose "
                        f"another directory (it is never overwritten)", 1)
    return str(run or "of no name")


class ExportWriter:
    """Writes an export layer by layer, in layer order; :meth:`finish` makes it whole, :meth:`abandon` removes what
    was written (a previous export in ``out`` stays as it was until :meth:`finish`).

    :param out: the export's directory
    :param spec: the run's spec as a dict (``RunSpec`` fields; its ``layout`` gives the file's header)
    :param run: the run's address, kept in ``model.json``
    :param source: where the layers came from: ``swarm`` or ``checkpoints``
    """

    def __init__(self, out: str, spec: Dict, run: str, source: str):
        self.out, self.spec, self.run, self.source = out, spec, run, source
        self.layout, self.layers = spec["layout"], []
        check_export_dir(out, "--out")
        self.writer = SafetensorsWriter(os.path.join(out, WEIGHTS), weight_entries(self.layout),
                                        {"format": FORMAT, "run": run})

    def add(self, index: int, state: Dict[str, torch.Tensor], step: int, served_by: Sequence[str] = ()) -> None:
        """Layer ``index``'s tensors (the next layer), the step its copy is at and the peers that served it."""
        if index != len(self.layers):
            raise ValueError(f"layer {index} written out of order (expected {len(self.layers)})")
        not_finite = first_non_finite(state)
        if not_finite is not None:  # never write a model whose weights hold a NaN (a damaged checkpoint)
            raise UserError(f"cannot export layer {index} ({self.layout[index][0]}): its {not_finite} holds non-finite "
                            f"values", 1)
        prefix = layer_prefixes(self.layout)[index]
        for key, _, _ in self.layout[index][1]:
            self.writer.write(f"{prefix}.{key}", state[key])
        self.layers.append(dict(index=index, name=self.layout[index][0], step=int(step), served_by=list(served_by)))

    def finish(self) -> Dict:
        """Rename the weights into place and write ``model.json`` beside them; returns the manifest."""
        manifest_path = os.path.join(self.out, MANIFEST)
        if os.path.exists(manifest_path):
            os.unlink(manifest_path)  # never an old manifest beside new weights, should we die between the two
        self.writer.finish()
        manifest = dict(format=FORMAT, run=self.run, source=self.source, exported_at=time.time(), spec=self.spec,
                        layers=self.layers)
        write_atomically(manifest_path, manifest_text(manifest).encode())
        for path in (manifest_path, os.path.join(self.out, WEIGHTS)):
            os.chmod(path, 0o644 & ~_umask())  # a model to share, not a secret (the temporary files were 0600)
        return manifest

    def abandon(self) -> None:
        self.writer.abandon()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def manifest_text(manifest: Dict) -> str:
    """``model.json`` for people too: a key per line, the spec's fields a line each, a line per layer."""
    def block(name: str, lines: List[str], close: str) -> str:
        return f' "{name}": {close[0]}\n' + ",\n".join(lines) + f"\n {close[1]}"

    parts = []
    for key, value in manifest.items():
        if key == "spec":
            parts.append(block(key, [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()], "{}"))
        elif key == "layers":
            parts.append(block(key, [f"  {json.dumps(layer)}" for layer in value], "[]"))
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def progress_bars(console: Console) -> Progress:
    """One bar per layer, as its bytes arrive and are written."""
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[note]}"),
                    console=console, transient=False)


async def export_run(options: ExportOptions, console: Console) -> Dict:
    """Export the run at ``options.run`` from its holders to ``options.out`` (module docstring); returns the manifest.
    Bad input (a run with no spec, a layer nobody serves, unreachable peers) is a one-line :class:`UserError`."""
    from ravnest_swarm.membership.records import make_validators, parse_run_address
    from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node

    address = parse_run_address(options.run)
    # before the swarm is asked: `--out ""` wrote into the current directory
    replaced = check_export_dir(options.out, "--out")
    if replaced is not None:
        console.print(f"{escape(options.out)} holds an export of run {escape(replaced)}: this one replaces it once "
                      f"it is whole", highlight=False, soft_wrap=True)
    node = await start_node(parse_maddrs(options.initial_peers),
                            record_validators=make_validators(address.name, address.owner),
                            client_mode=True, timeout=options.timeout, rpc_timeout=options.timeout)
    try:
        return await export_with(node, address, options.out, options.transfer_timeout, console)
    finally:
        await stop_node(node)


async def export_with(node, address, out: str, transfer_timeout: float, console: Optional[Console]) -> Dict:
    """The export of the run at ``address`` (a ``RunAddress``) to ``out`` through ``node`` (a started DHT node with
    its routes, not one of the run's holders: a node cannot call itself); returns the manifest.

    :param console: where the progress bars go (None: none, a peer's snapshot in the background)
    """
    from ravnest_swarm.membership.owner import spec_owner
    from ravnest_swarm.membership.reader import read_adopted_plan, read_peers
    from ravnest_swarm.membership.records import RunAddress
    from ravnest_swarm.membership.view import PeerView
    from ravnest_swarm.net.node import maddrs_without_peer_id
    from ravnest_swarm.swarm.spec import RunSpec, choose_spec, read_specs
    from ravnest_swarm.swarm.state_transfer import fill_layer, offers_of

    run = address.name
    chosen = choose_spec(await read_specs(node, run), address)
    if chosen is None:
        raise UserError(f"run {address} has no spec in the DHT: check its name (case-sensitive) and owner, and "
                        f"that --initial-peers are the run's backbones", 1)
    spec = RunSpec.from_record(chosen)
    full_address = str(RunAddress(run, spec_owner(chosen)))
    model = _model_of(spec)
    view, offers = PeerView(), {}
    for _ in range(2):  # one read can miss records that a DHT node did not answer in time: a second one adds to it
        records = await read_peers(node, run, view=view)
        plan = await read_adopted_plan(node, run, records)
        offers = {layer: offers_of(records, plan, layer) for layer in range(len(model.layers))}
        if all(offers.values()):
            break
    peers = {record["peer_id"]: record for record in records}
    unserved = [layer for layer, found in offers.items() if not found]
    if unserved:
        named = ", ".join(f"{layer} ({model.layers[layer].name})" for layer in unserved)
        raise UserError(f"nobody serves layer{'s' if len(unserved) > 1 else ''} {named} of run {full_address} "
                        f"({len(peers)} live peer(s)): its holders have left; export it when one is back", 1)

    async def reach(holder) -> str:
        record = peers[holder.to_base58()]
        return await node.routes.connect(holder, maddrs_without_peer_id(record["maddrs"], holder),
                                         record.get("reachability"))

    fields = dict(asdict(spec), layout=[list(layer) for layer in spec.layout])
    writer = ExportWriter(out, fields, full_address, "swarm")
    try:
        with progress_bars(console or Console(quiet=True)) as progress:
            tasks = [progress.add_task(f"layer {i} {layer.name}", total=layer.param_bytes, note="")
                     for i, layer in enumerate(model.layers)]
            for layer in range(len(model.layers)):
                module = model.build_layer(layer)
                filled = await fill_layer(node.routes, run, module, layer, offers[layer], transfer_timeout, reach=reach)
                if not filled.loaded:
                    raise UserError(f"cannot export layer {layer} ({model.layers[layer].name}) of run "
                                    f"{full_address}: {filled.problem}", 1)
                writer.add(layer, module.state_dict(), filled.copy_step, filled.holders)
                names = ", ".join(peers[h].get("name", h[:12]) for h in filled.holders)
                progress.update(tasks[layer], completed=model.layers[layer].param_bytes,
                                note=f"step {filled.copy_step} from {names}")
                del module
        return writer.finish()
    except BaseException:
        writer.abandon()
        raise


def _model_of(spec) -> ModelSpec:
    """The run's model from this machine's code, checked against the spec's layout (no data needed: only the
    layers' shapes are)."""
    from ravnest_swarm.models import first_difference, model_layout, model_structure

    try:
        model = model_structure(spec.model, spec.model_config)
    except ValueError as e:
        raise UserError(f"cannot build the run's model {spec.model}: {e}", 1)
    if spec.layout is None:
        raise UserError(f"the run's spec names no layout of {spec.model}: it was started by an older version", 1)
    difference = first_difference(model_layout(model), spec.layout)
    if difference is not None:
        raise UserError(f"your code builds a different model from the run's {spec.model}: {difference}; install the "
                        f"code the run was started with", 1)
    return model


async def run_export(options: ExportOptions) -> int:
    """``ravnest-swarm export``: export, then one line saying what was written."""
    console = Console(stderr=True)
    manifest = await export_run(options, console)
    steps = sorted({layer["step"] for layer in manifest["layers"]})
    holders = {peer for layer in manifest["layers"] for peer in layer["served_by"]}
    print(f"exported {manifest['spec']['model']} of run {manifest['run']} to {options.out}: {len(manifest['layers'])} "
          f"layers at step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}, served by {len(holders)} "
          f"peer(s)", flush=True)
    return 0


# ---------------------------------------------------------------- from a local run's checkpoints

def freshest_checkpoint_layers(directory: str, pattern: "re.Pattern") -> Dict[int, Tuple[str, int, int]]:
    """For each layer of the checkpoints in ``directory`` whose file name matches ``pattern``: ``(file, step, index
    in the file's stage)`` of its freshest copy. Only the files' headers are read; a file that does not read is
    skipped (a killed writer's leftover)."""
    layers: Dict[int, Tuple[str, int, int]] = {}
    for name in sorted(os.listdir(directory)):
        if not pattern.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            with safe_open(path, framework="pt") as file:
                info = json.loads(file.metadata()["ravnest"])["info"]
            start, end, step = int(info["layers"][0]), int(info["layers"][1]), int(info["step"])
        except Exception:
            continue
        for layer in range(start, end):
            if layer not in layers or layers[layer][1] < step:
                layers[layer] = (path, step, layer - start)
    return layers


def checkpoint_layer_state(source: Tuple[str, int, int]) -> Dict[str, torch.Tensor]:
    """One layer's tensors from the checkpoint ``source`` names (:func:`freshest_checkpoint_layers`), only those."""

    path, _, offset = source
    prefix = f"param.{offset}."
    with safe_open(path, framework="pt") as file:
        return {key[len(prefix):]: file.get_tensor(key) for key in file.keys() if key.startswith(prefix)}


def export_checkpoints(sources: Dict[int, Tuple[str, int, int]], spec: Dict, run: str, out: str) -> Dict:
    """Write the export of a ``local`` run from its checkpoints (``sources``: :func:`freshest_checkpoint_layers`),
    one layer in memory at a time; ``spec``: the run's spec as a dict, its layout included. Returns the manifest."""
    writer = ExportWriter(out, spec, run, "checkpoints")
    try:
        for layer in range(len(spec["layout"])):
            if layer not in sources:
                raise UserError(f"cannot export layer {layer} ({spec['layout'][layer][0]}): no checkpoint holds it", 1)
            writer.add(layer, checkpoint_layer_state(sources[layer]), sources[layer][1],
                       [os.path.basename(sources[layer][0])])
        return writer.finish()
    except BaseException:
        writer.abandon()
        raise
