"""Sized, configured and user models, and user data: built from local code, fingerprinted, checked (no network)."""

import os
import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ravnest_swarm.errors import UserError
from ravnest_swarm.models import PRESETS, first_difference, load_model, model_layout
from ravnest_swarm.models.user_data import scan_data
from ravnest_swarm.swarm.spec import RunSpec, model_facts

USER_MODELS = os.path.join(os.path.dirname(__file__), "user_models")


@pytest.fixture
def user_models_on_path(monkeypatch):
    monkeypatch.syspath_prepend(USER_MODELS)
    yield
    sys.modules.pop("tabular", None)


def features_dir(path, samples=1200, features=16, seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(samples, features)).astype(np.float32)
    targets = (inputs @ rng.normal(size=(features, 4))).argmax(axis=1)
    os.makedirs(path, exist_ok=True)
    np.save(os.path.join(path, "inputs.npy"), inputs)
    np.save(os.path.join(path, "targets.npy"), targets)
    return str(path)


def text_dir(path, text=b"def add(a, b):\n    return a + b\n" * 400):
    os.makedirs(path, exist_ok=True)
    for index, part in enumerate((text[: len(text) // 2], text[len(text) // 2:])):
        with open(os.path.join(path, f"part{index}.txt"), "wb") as f:
            f.write(part)
    return str(path)


def training_state_bytes(spec):
    """Parameters and their gradients, float32 (plain SGD keeps no other state)."""
    return 2 * sum(layer.param_bytes for layer in spec.layers)


def test_a_preset_holds_more_than_a_gigabyte_of_training_state_and_is_built_layer_by_layer():
    assert training_state_bytes(load_model("gpt-350m")) > 2e9
    assert training_state_bytes(load_model("gpt-85m")) > 0.6e9
    spec = load_model("gpt-85m")
    # embedding and head are layers like the blocks: the planner places each where memory allows
    assert [layer.name for layer in spec.layers][:2] == ["embed", "block0"] and spec.layers[-1].name == "head"
    stage = spec.build_stage(5, 6)  # one block: a peer allocates only what it owns
    assert sum(p.numel() for p in stage.parameters()) == spec.layers[5].param_count < 8e6


def test_model_config_sets_the_size_and_presets_take_overrides():
    small = load_model("gpt", "layers=2,width=32,heads=2,context=16")
    assert len(small.layers) == 4 and small.layers[1].input_shape == (16, 32)
    assert load_model("gpt-tiny", "context=32").layers[0].input_shape == (32,)
    assert set(PRESETS) >= {"gpt-tiny", "gpt-85m", "gpt-350m"}
    for name, config, fragment in [("gpt", "depth=3", "model gpt takes layers, width, heads, context, vocab"),
                                   ("gpt", "width=33", "multiple of heads"), ("gpt", "layers", "must look like"),
                                   ("gpt-tiny", "layers=0", "positive whole number")]:
        with pytest.raises(ValueError, match=fragment):
            load_model(name, config)


def test_a_user_entry_point_builds_shapes_and_flops_on_meta_and_trains_on_user_data(tmp_path, user_models_on_path):
    spec = load_model("tabular:build", "hidden=32", features_dir(tmp_path / "data"))
    assert [layer.input_shape for layer in spec.layers] == [(16,), (32,), (32,), (32,)]
    assert all(layer.flops_per_sample > 0 for layer in spec.layers)
    inputs, targets = spec.dataset().get(range(8))
    assert inputs.dtype == torch.float32 and targets.dtype == torch.long
    assert spec.dataset().size == 1000 and spec.heldout().size == 200  # every 6th sample held out
    loss = spec.loss(spec.build_full()(inputs), targets)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name, fragment", [
    ("tabular:missing", "has no function 'missing'"),
    ("no_such_module:build", "cannot import 'no_such_module' for --model no_such_module:build: ModuleNotFoundError: "
                             "No module named 'no_such_module' (run from its directory, or put that directory on "
                             "PYTHONPATH)"),
    ("os:getcwd", "returned str, not a ModelSpec"),
    # a user's review: a file's name or path was Python's "'tabular' is not a package" or a relative-import error
    ("tabular.py:build", "--model tabular.py:build: give the module's name, not its file (tabular:build)"),
    ("./models/tabular:build", "give the module's name, not its file (tabular:build), from its directory"),
])
def test_a_broken_entry_point_is_one_line(name, fragment, user_models_on_path):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_model(name)


def test_a_user_model_without_data_asks_for_it(user_models_on_path):
    with pytest.raises(ValueError, match="has no data of its own: give --data"):
        load_model("tabular:build")


def test_the_first_layout_difference_is_named(tmp_path, user_models_on_path):
    data = features_dir(tmp_path / "data")
    run = model_layout(load_model("tabular:build", "", data))
    assert first_difference(run, run) is None
    assert first_difference(model_layout(load_model("tabular:build", "hidden=48", data)), run) == \
        "layer 0 (inner): yours has 0.weight [48, 16] float32, the run's 0.weight [64, 16] float32"
    assert first_difference(run[:3], run) == "yours has 3 layers, the run's 4"


def test_the_spec_refuses_a_build_or_data_that_differs(tmp_path, user_models_on_path):
    data = features_dir(tmp_path / "data")
    spec = RunSpec(model="tabular:build", **model_facts("tabular:build", "", data))
    assert spec.build_model(data).name == "tabular"
    with pytest.raises(UserError, match=r"builds a different model from the run's tabular:build: layer 0 \(inner\)"):
        RunSpec(model="tabular:build", model_config="hidden=48", layout=spec.layout, data_hash=spec.data_hash,
                data_bytes=spec.data_bytes).build_model(data)
    with pytest.raises(UserError, match="differs from the run's"):
        spec.build_model(features_dir(tmp_path / "other", seed=1))
    with pytest.raises(UserError, match="pass --data with your copy"):
        spec.build_model(None)
    with pytest.raises(UserError, match="drop --data"):
        RunSpec(model="mlp-digits").build_model(data)


def test_text_and_token_directories_make_windows_of_the_models_context(tmp_path):
    spec = load_model("gpt", "layers=1,width=16,heads=2,context=16", text_dir(tmp_path / "text"))
    inputs, targets = spec.dataset().get([0, 1])
    assert inputs.shape == (2, 16) and inputs.dtype == torch.long
    assert torch.equal(inputs[0, 1:], targets[0, :-1])  # targets are the inputs shifted by one
    assert scan_data(str(tmp_path / "text")).kind == "text"
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    np.save(tokens / "ids.npy", np.arange(3000) % 200)
    assert load_model("gpt", "layers=1,width=16,heads=2,context=16", str(tokens)).dataset().size > 100
    np.save(tokens / "ids.npy", np.arange(3000))  # ids past the byte vocabulary
    scan_data.cache_clear()
    with pytest.raises(ValueError, match="token ids run from 0 to 2999, model gpt takes 0-255"):
        load_model("gpt", "layers=1,width=16,heads=2,context=17", str(tokens))


def test_the_content_hash_follows_the_bytes(tmp_path):
    first = scan_data(text_dir(tmp_path / "a"))
    assert scan_data(text_dir(tmp_path / "b")).digest == first.digest  # same files elsewhere: same data
    assert scan_data(text_dir(tmp_path / "c", b"x" * 20000)).digest != first.digest


def test_bad_data_directories_are_one_line(tmp_path, user_models_on_path):
    cases = {}
    cases["missing"] = str(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    cases["empty"] = str(tmp_path / "empty")
    mixed = features_dir(tmp_path / "mixed")
    (tmp_path / "mixed" / "notes.txt").write_text("hello")
    cases["mixed"] = mixed
    unreadable = text_dir(tmp_path / "unreadable")
    os.symlink(tmp_path / "gone.txt", tmp_path / "unreadable" / "link.txt")  # root reads any file: a dangling link
    cases["unreadable"] = unreadable
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    np.save(pickled / "ids.npy", np.array([{"code": 1}] * 10, dtype=object), allow_pickle=True)
    expected = {"missing": "no such directory", "empty": "holds no files", "mixed": "mixes .npy arrays",
                "unreadable": "cannot read link.txt", "pickled": "not a numeric .npy array"}
    for name, path in cases.items():
        with pytest.raises(ValueError, match=expected[name]):
            load_model("gpt-tiny", "", path)
    with pytest.raises(ValueError, match=expected["pickled"]):
        load_model("gpt-tiny", "", str(pickled))
    with pytest.raises(ValueError, match=r"samples of shape \[16\], but model mlp-digits takes \[64\]"):
        load_model("mlp-digits", "", features_dir(tmp_path / "narrow"))
    with pytest.raises(ValueError, match="holds text, but model tabular takes"):
        load_model("tabular:build", "", text_dir(tmp_path / "text"))


def test_a_not_finite_value_in_the_features_is_one_line_naming_the_sample(tmp_path, user_models_on_path):
    """One NaN in inputs.npy made stage 0's output non-finite at every pass over it: a "divergence" that restored
    the layers to their start once an epoch, and a run that said nothing else failed."""
    path = features_dir(tmp_path / "nan")
    inputs = np.load(os.path.join(path, "inputs.npy"))
    inputs[37, 3] = np.nan
    np.save(os.path.join(path, "inputs.npy"), inputs)
    with pytest.raises(ValueError, match=r"inputs.npy holds a value that is not finite \(NaN or infinite\) in "
                                         r"sample 37"):
        load_model("tabular:build", "", path)


def test_batch_norm_dropout_and_parameter_free_layers_build_and_evaluate_in_eval_mode(tmp_path, user_models_on_path):
    """Batch norm refused the batch of one the layers were built on (``sequential_model``); the figures of ``local``
    and ``evaluate`` ran the layers in training mode (dropout on: two evaluations of one export differed), and
    counted ignored targets (-100) as misses."""
    from ravnest_swarm.models import accuracy_counts
    from ravnest_swarm.swarm.exported import model_figures

    model = load_model("tabular:build_normalised", "", features_dir(tmp_path / "features"))
    assert [layer.param_count for layer in model.layers][1] == 0
    assert model.layers[0].flops_per_sample > 0 and model.layers[0].activation_bytes > 0
    assert model_figures(model, None) == model_figures(model, None)  # no dropout: the same figures every time
    with pytest.raises(ValueError, match="layers 'inner' and 'again' of model tabular_tied share a parameter "
                                         r"\(tied weights\)"):
        load_model("tabular:build_tied", "", features_dir(tmp_path / "features"))
    outputs = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert accuracy_counts(outputs, torch.tensor([1, 0, -100])) == (2, 2)


def test_a_sequences_class_scores_may_come_second_as_torchs_cross_entropy_takes_them():
    """Outputs ``(N, C, L)`` for targets ``(N, L)`` (torch's layout for a sequence): a label of class 8 of 9 was
    refused as out of range of the last dimension (the length), and the accuracy took the argmax over positions."""
    from ravnest_swarm.models import accuracy_counts, class_dim
    from ravnest_swarm.pipeline.compute import check_targets

    outputs, targets = torch.zeros(2, 9, 4), torch.full((2, 4), 8)
    outputs[:, 8, :3] = 1.0
    assert class_dim(outputs, targets) == 1 and class_dim(torch.zeros(2, 4, 9), targets) == -1
    check_targets(targets, outputs.shape[class_dim(outputs, targets)])
    assert accuracy_counts(outputs, targets) == (6, 8)


@pytest.mark.parametrize("mode", ["stash", "recompute"])
def test_the_backward_is_of_the_forward_that_was_sent_dropout_and_batch_norm_included(tmp_path, user_models_on_path,
                                                                                        mode):
    """Under ``--backward recompute`` the forward ran again with a fresh dropout mask, so the gradient was of another
    function than the output the next stage used (a gradient only on outputs dropped gave an input gradient of 2.57,
    not 0), and batch norm's running statistics counted every microbatch twice."""
    from ravnest_swarm.pipeline.compute import StageCompute
    from ravnest_swarm.pipeline.config import StageConfig

    data = features_dir(tmp_path / "features")
    config = StageConfig(run="r", stage=1, stages=2, model="tabular:build_normalised", layers=(0, 1), data=data,
                         mode=mode, lr=0.0)
    compute = StageCompute(config, load_model("tabular:build_normalised", "", data))
    torch.manual_seed(0)
    pending, output = compute.forward(torch.randn(8, 16))
    dropped = (output == 0).float()
    assert 0 < dropped.mean() < 1
    input_grad = compute.backward(pending, dropped)
    assert float(input_grad.abs().max()) == 0.0
    assert int(compute.module[0][1].num_batches_tracked) == 1


def test_targets_the_models_output_cannot_be_scored_against_are_one_line(tmp_path, user_models_on_path):
    """Class labels as a column failed every microbatch of a run, then its evaluation; float targets ``(N,)`` for
    outputs ``(N, 4)`` would broadcast in a mean squared error, the model learning only their mean."""
    column = features_dir(tmp_path / "column")
    np.save(os.path.join(column, "targets.npy"), np.load(os.path.join(column, "targets.npy"))[:, None])
    with pytest.raises(ValueError, match=r"class labels of shape \[1\] a sample, but model tabular outputs \[4\] a "
                                         r"sample: they must be of shape \[\], the model's output less its class"):
        load_model("tabular:build", "", column)
    floats = features_dir(tmp_path / "floats")
    np.save(os.path.join(floats, "targets.npy"), np.linspace(0, 1, 1200, dtype=np.float32))
    with pytest.raises(ValueError, match=r"float targets of shape \[\] a sample, but model tabular outputs \[4\]"):
        load_model("tabular:build", "", floats)




@pytest.mark.parametrize("labels, problem", [
    (lambda n: np.arange(n) % 10, "class labels run from 0 to 9, but model tabular outputs 4 classes: labels must "
                                  "lie in 0-3"),
    (lambda n: np.arange(n) % 4 - 1, "class labels run from -1 to 2"),
    (lambda n: np.arange(n) % 2 == 0, "targets.npy holds true/false values: give class labels as integers"),
])
def test_labels_the_model_cannot_score_are_one_line_before_any_training(tmp_path, user_models_on_path, labels,
                                                                        problem):
    """A user's review: labels 0-9 for a 4-class model were taken, and the run dropped every microbatch for its whole
    time limit before an unexpected IndexError; true/false labels were called "float targets"."""
    path = features_dir(tmp_path / "labels")
    np.save(os.path.join(path, "targets.npy"), labels(1200))
    with pytest.raises(ValueError, match=re.escape(problem)):
        load_model("tabular:build", "", path)


@pytest.mark.parametrize("loss, problem", [
    ("cross_entropy", "model lossy's loss is a str, not a function: give loss(outputs, targets)"),
    (lambda outputs, targets: F.cross_entropy(outputs, targets, reduction="none"),
     "loss returns a tensor of shape [2]: it must return one number, the mean over the microbatch"),
    (lambda outputs, targets: float(F.cross_entropy(outputs, targets)), "loss returns a float: it must return one"),
])
def test_a_loss_that_cannot_train_is_one_line_before_any_training(tmp_path, loss, problem):
    """A user's review: a loss given as a string spun in a busy loop of dropped microbatches (15,000 in 40 s)."""
    from ravnest_swarm.models import sequential_model
    from ravnest_swarm.models.user_data import bind_data

    spec = sequential_model("lossy", [("head", lambda: torch.nn.Linear(16, 4))], input_shape=(16,), loss=loss)
    with pytest.raises(ValueError, match=re.escape(problem)):
        bind_data(spec, features_dir(tmp_path / "data"))


def test_a_loss_that_wants_outputs_in_a_range_or_raises_on_made_up_ones_is_taken(tmp_path):
    """A review: the loss was tried on unseeded normal outputs, so a sigmoid head with binary cross-entropy was
    refused 18 times in 20 ("all elements of input should be between 0 and 1"). Outputs in (0, 1), seeded; a loss
    that raises on them anyway is not judged."""
    from ravnest_swarm.models import sequential_model
    from ravnest_swarm.models.user_data import bind_data

    data = features_dir(tmp_path / "data")
    np.save(os.path.join(data, "targets.npy"), np.random.default_rng(0).random((1200, 4), dtype=np.float32))

    def picky(outputs, targets):
        raise ValueError("a scale must be positive")

    for loss in (F.binary_cross_entropy, picky):
        spec = sequential_model("probabilities", [("head", lambda: torch.nn.Sequential(torch.nn.Linear(16, 4),
                                                                                      torch.nn.Sigmoid()))],
                                input_shape=(16,), loss=loss)
        assert bind_data(spec, data).dataset().size == 1000


def test_labels_of_a_sequence_whose_class_scores_come_second_are_checked_against_the_classes(tmp_path):
    """A review: for outputs (N, C, L) the range check took L for the classes."""
    from ravnest_swarm.models import sequential_model
    from ravnest_swarm.models.user_data import bind_data

    spec = sequential_model("ncl", [("head", lambda: torch.nn.Sequential(torch.nn.Linear(16, 15),
                                                                        torch.nn.Unflatten(1, (5, 3))))],
                            input_shape=(16,))
    data = features_dir(tmp_path / "data")
    np.save(os.path.join(data, "targets.npy"), np.arange(3600).reshape(1200, 3) % 5)  # 5 classes at 3 places
    assert bind_data(spec, data).dataset().size == 1000
    np.save(os.path.join(data, "targets.npy"), np.arange(3600).reshape(1200, 3) % 6)
    scan_data.cache_clear()  # the same path, other content
    with pytest.raises(ValueError, match=re.escape("class labels run from 0 to 5, but model ncl outputs 5 classes")):
        bind_data(spec, data)



def test_a_layer_given_as_a_module_or_that_fails_on_its_input_is_named():
    """A user's review: layers given as modules (not builders) said "forward() missing 1 required positional
    argument", and a shape mismatch torch's "a and b must have same reduction dim", naming no layer."""
    from ravnest_swarm.models import sequential_model

    with pytest.raises(ValueError, match=re.escape("layer 'a' of model m is a Linear, not a function that builds it: "
                                                   "give (name, lambda: nn.Linear(...))")):
        sequential_model("m", [("a", torch.nn.Linear(16, 4))], input_shape=(16,))
    with pytest.raises(ValueError, match=re.escape("layer 'a' of model m builds a int, not a torch.nn.Module")):
        sequential_model("m", [("a", lambda: 3)], input_shape=(16,))
    with pytest.raises(ValueError, match=re.escape("layer 'b' of model m fails on its input, of shape [64] a sample "
                                                   "(float32): RuntimeError: ")):
        sequential_model("m", [("a", lambda: torch.nn.Linear(16, 64)), ("b", lambda: torch.nn.Linear(32, 4))],
                         input_shape=(16,))



class TokensAndPositions(torch.nn.Module):
    def __init__(self, vocab, context, width):
        super().__init__()
        self.positions = torch.nn.Embedding(context, width)  # registered first, and the larger
        self.tokens = torch.nn.Embedding(vocab, width)

    def forward(self, ids):
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


def test_a_token_model_that_names_no_vocabulary_is_checked_against_its_embedding_and_an_empty_layer_is_refused(
        tmp_path):
    """A user's review: a token model without ``vocab=`` took ids past its embedding (every microbatch then failed
    on an IndexError), and ``--model-config hidden=0`` started a swarm that trained a model of no width."""
    from ravnest_swarm.models import sequential_model
    from ravnest_swarm.models.user_data import bind_data

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    np.save(tokens / "ids.npy", np.arange(3000) % 200)
    spec = sequential_model("words", [("embed", lambda: torch.nn.Embedding(16, 8)),
                                      ("head", lambda: torch.nn.Linear(8, 16))],
                            input_shape=(8,), input_dtype=torch.long)
    with pytest.raises(ValueError, match=re.escape("token ids run from 0 to 199, model words takes 0-15")):
        bind_data(spec, str(tokens))
    # a byte model's positional embedding (512 rows) is larger than its tokens' (16): the tokens' is the one that
    # looks the input up, and ids past it are refused still
    positioned = sequential_model("positioned", [("embed", lambda: TokensAndPositions(16, 512, 8)),
                                                 ("head", lambda: torch.nn.Linear(8, 16))],
                                  input_shape=(8,), input_dtype=torch.long)
    with pytest.raises(ValueError, match=re.escape("token ids run from 0 to 199, model positioned takes 0-15")):
        bind_data(positioned, str(tokens))
    with pytest.raises(ValueError, match=re.escape("layer 'inner' of model empty returns an empty tensor (shape [0] a "
                                                   "sample): check the model's settings")):
        sequential_model("empty", [("inner", lambda: torch.nn.Linear(16, 0)), ("head", lambda: torch.nn.Linear(0, 4))],
                         input_shape=(16,))


class Pair(torch.nn.Module):
    def forward(self, x):
        return x, x


def test_a_layer_that_returns_a_tuple_and_big_endian_features_are_handled_in_words(tmp_path, user_models_on_path):
    from ravnest_swarm.models import sequential_model

    with pytest.raises(ValueError, match="layer 'pair' of model pairs returns a tuple: a layer takes one tensor and "
                                         "returns one"):
        sequential_model("pairs", [("pair", Pair), ("head", lambda: torch.nn.Linear(16, 4))], input_shape=(16,))
    path = features_dir(tmp_path / "big_endian")
    inputs = np.load(os.path.join(path, "inputs.npy"))
    np.save(os.path.join(path, "inputs.npy"), inputs.astype(">f4"))  # torch refused the byte order, no path named
    samples, _ = load_model("tabular:build", "", path).dataset().get(range(2))
    assert torch.equal(samples, torch.as_tensor(inputs[[0, 1]]))
