"""The model zoo: models that split into stages by layer range, and their data by sample id."""

from ravnest_swarm.models.data import Dataset, ShardedSampler
from ravnest_swarm.models.zoo import MODELS, LayerSpec, ModelSpec, balanced_split, get_model, parse_layers
