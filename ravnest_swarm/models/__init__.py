"""The model zoo: models that split into stages by layer range, and their data by sample id.

``load_model`` builds what a run names: a zoo family or preset, or a user's ``module:function``
(``sequential_model`` makes one from plain modules), on its own data or a user's ``--data``.
"""

from ravnest_swarm.models.data import Dataset, ShardedSampler
from ravnest_swarm.models.loading import (first_difference, get_model, layout_fingerprint, load_model, model_layout,
                                          model_structure, parse_model_config, sequential_model)
from ravnest_swarm.models.zoo import (IGNORED_TARGET, MODELS, PRESETS, LayerSpec, ModelSpec, accuracy_counts, class_dim,
                                      balanced_split, parse_layers)
