"""ravnest-swarm: volunteers train one model together over a hivemind DHT.

Importing this package installs a light entry for ``hivemind``: hivemind's own ``__init__`` eagerly
imports every subsystem (MoE servers, optimizers, averaging), which costs about two seconds and a
few hundred MB in every process. We import the hivemind submodules we use by their full names
(``hivemind.dht.node``, ``hivemind.p2p``, ``hivemind.compression``), so the package object only
needs its search path. This is what keeps a backbone process small (see ``bench backbone``).
"""

import importlib.util
import sys
import types

__version__ = "0.1.0"
# 2: ring members say they reached a round (`arrive` notes) and a ring starts once all have; a peer of 1 never says so
# 3: a spec signs its run and origin, records' subkeys have one shape each, replies are read bounded: a peer of 2
#    refuses our specs as malformed, and we refuse its
# 4: a robust ring's probe reply carries the owner's aggregate: a peer of 3 answers without it, refused as an owner
# 5: peer records carry fields a peer of 4 does not know (`kept_rounds`, `leaving_after_round`, ...): its schema
#    validator, which compares a record with what it parsed, refuses them, and our records would vanish from its view
# 6: ring members are ordered by peer id, not by cluster (a renumbered cluster keeps its rings), and a stage takes
#    messages naming its cluster's number before a renumbering: a peer of 5 owns other chunks of the same ring
PROTOCOL_VERSION = 6


def _install_light_hivemind_package() -> None:
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed: the import that needs it will say so
    package = types.ModuleType("hivemind")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    sys.modules["hivemind"] = package


_install_light_hivemind_package()


def load_model(path: str):
    """The whole trained model of the export at ``path`` (``ravnest-swarm export``, ``local --export``) as one torch
    module, built from this machine's code (the zoo, or the entry point the run names) with the exported weights;
    a missing or corrupt export is a one-line ``UserError``. ``ravnest_swarm/swarm/exported.py`` says more."""
    from ravnest_swarm.swarm.exported import load_model as load_export  # torch only when asked for

    return load_export(path)
