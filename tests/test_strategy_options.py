"""Strategy's options come from the features: the dataclass fields are the core's, every other option is declared by
the feature that carries it out. A built-in option and a user feature's option behave the same (keyword, attribute,
default, assignment, ``str``/``repr``, equality); ``Strategy.__doc__`` lists every option with its doc; the pairwise
checks are generated from ``requires`` / ``conflicts_with`` and name both features and the options that enabled
them; a shared option (``grad_sync``) is carried out by whichever feature lists it in ``enabled_by``."""
import inspect
import re
from dataclasses import dataclass, fields

import pytest

import fxpar
from fxpar.compress import registered_methods
from fxpar.feature import option_owner, registered_features, shared_options, unregister_feature

pytestmark = pytest.mark.structure

CORE = {"dp", "tp", "pp", "microbatches", "loss_average", "passes", "options", "schedule", "split_points",
        "bucket_cap_mb", "first_bucket_cap_mb", "broadcast_buffers"}


@dataclass
class _Section(fxpar.PlanSection):
    level: int = 0


class _Level(fxpar.Feature):
    """A user feature with one option, registered beside the built-ins for the comparisons below."""
    name = "test_level"
    doc = "a test feature"
    options = {"test_level": fxpar.Option(0, "how much of the test feature: 0 off")}
    section = _Section


class _Sum(fxpar.Feature):
    """A user feature that carries out one value of the shared ``grad_sync`` option."""
    name = "test_sum"
    doc = "a test gradient-sync method"
    enabled_by = ("grad_sync",)

    def enabled(self, strategy):
        return strategy.grad_sync == "test_sum"


@pytest.fixture
def user_features():
    fxpar.register_feature(_Level)
    fxpar.register_feature(_Sum)
    try:
        yield
    finally:
        unregister_feature(_Level.name)
        unregister_feature(_Sum.name)


def test_the_fields_are_the_cores_only():
    assert {f.name for f in fields(fxpar.Strategy)} <= CORE
    for f in registered_features():
        for k in f.options:
            assert option_owner(k) == f.name and k not in {x.name for x in fields(fxpar.Strategy)}, k
    assert "feature_options" in inspect.signature(fxpar.Strategy).parameters


def test_doc_lists_every_option_with_its_doc():
    doc = " ".join(fxpar.Strategy.__doc__.split())          # wrapped lines joined
    for f in fields(fxpar.Strategy):
        assert f"{f.name} (default " in doc, f.name
    opts = {k: o for f in registered_features() for k, o in f.options.items()}
    opts.update({k: o for k, (o, _) in shared_options().items()})
    assert {"zero", "offload", "offload_to", "offload_dir", "recompute", "memory_budget_gb", "grad_sync",
            "delayed_update", "offload_activations", "comm_schedule", "partition_mb", "credit_mb", "sharding",
            "grad_order", "cross_iteration"} <= set(opts)
    for k, o in opts.items():
        assert o.doc and f"{k} (default {o.default!r}): {' '.join(o.doc.split())}" in doc, k
    for name in shared_options()["grad_sync"][1]:
        assert f"{name!r}: " in doc
    assert " ".join(inspect.getdoc(fxpar.Strategy).split()) == " ".join(doc.split())


def test_doc_lists_a_feature_registered_later(user_features):
    doc = " ".join(fxpar.Strategy.__doc__.split())
    assert "Feature 'test_level' (" in doc and "test_level (default 0): how much of the test feature: 0 off" in doc
    assert "'test_sum': a test gradient-sync method" in doc


@pytest.mark.parametrize("name,value,default", [("zero", 2, 0), ("test_level", 2, 0)])
def test_a_builtin_option_behaves_as_a_user_features(user_features, name, value, default):
    s = fxpar.Strategy(dp=2, **{name: value})
    assert getattr(s, name) == value and s.option(name) == value and s.options == {name: value}
    assert getattr(fxpar.Strategy(dp=2), name) == default and fxpar.Strategy(dp=2).options == {}
    assert str(s) == f"Strategy(dp=2, tp=1, pp=1, {name}={value})"
    assert repr(s) == f"Strategy(dp=2, {name}={value})"
    assert s == fxpar.Strategy(dp=2, **{name: value}) and s != fxpar.Strategy(dp=2)
    assert fxpar.Strategy(dp=2, **{name: default}) == fxpar.Strategy(dp=2)      # the default given equals unset
    s2 = fxpar.Strategy(dp=2)
    setattr(s2, name, value)
    assert s2 == s and s2.options == {name: value}
    with pytest.raises(fxpar.StrategyError, match=rf"Strategy\({name}x=...\): no registered feature owns option "
                                                  rf"'{name}x' \(did you mean '{name}'\?\)"):
        fxpar.Strategy(dp=2, **{name + "x": value})
    with pytest.raises(AttributeError, match=rf"no option '{name}x' \(did you mean '{name}'\?\)"):
        setattr(s, name + "x", value)
    with pytest.raises(AttributeError, match=rf"no attribute '{name}x'"):
        getattr(s, name + "x")


def test_str_shows_core_fields_then_enabled_features_options():
    s = fxpar.Strategy(dp=2, pp=2, microbatches=4, schedule="gpipe", comm_schedule="bytescheduler",
                       cross_iteration=True)
    assert str(s) == ("Strategy(dp=2, tp=1, pp=2, schedule=gpipe, microbatches=4, comm_schedule='bytescheduler', "
                      "cross_iteration=True)")
    assert str(fxpar.Strategy(dp=2, grad_sync="parallax")) == "Strategy(dp=2, tp=1, pp=1, grad_sync='parallax')"
    assert str(fxpar.Strategy(tp=2, sharding={"fc.weight": ("tp", None)})) == \
        "Strategy(dp=1, tp=2, pp=1, sharding=<dict of 1>)"
    assert repr(fxpar.Strategy(dp=2, delayed_update=True)) == \
        "Strategy(dp=2, comm_schedule='bytescheduler', delayed_update=True)"       # settle() set comm_schedule


def test_generated_conflict_names_both_features_and_options():
    with pytest.raises(fxpar.StrategyError, match=r"feature 'tensor_parallel' \(tp=2\) conflicts with feature "
                                                  r"'zero' \(zero=1\): they do not compose; drop one of them"):
        fxpar.Strategy(dp=2, tp=2, zero=1)
    with pytest.raises(fxpar.StrategyError, match=r"feature 'herring' \(grad_sync='herring'\) conflicts with "
                                                  r"feature 'bytescheduler' \(comm_schedule='bytescheduler'\)"):
        fxpar.Strategy(dp=2, grad_sync="herring", comm_schedule="bytescheduler")
    with pytest.raises(fxpar.StrategyError, match=r"feature 'parallax' \(grad_sync='parallax'\) conflicts with "
                                                  r"feature 'tensor_parallel' \(tp=2\)"):
        fxpar.Strategy(dp=2, tp=2, grad_sync="parallax")


def test_a_shared_option_is_carried_out_by_the_feature_that_lists_it(user_features):
    methods = ", ".join(repr(n) for n in ["herring", "byteps", "parallax", *registered_methods(), "test_sum"])
    with pytest.raises(fxpar.StrategyError, match=r"Strategy\(grad_sync='nope'\): choose 'allreduce' \(the default\) "
                                                  r"or a method a registered feature carries out: " + re.escape(methods)):
        fxpar.Strategy(dp=2, grad_sync="nope")
    s = fxpar.Strategy(dp=2, grad_sync="test_sum")
    assert s.grad_sync == "test_sum" and str(s) == "Strategy(dp=2, tp=1, pp=1, grad_sync='test_sum')"
    on = [f.name for f in fxpar.feature.enabled_features(s)]
    # the shared option's value enables its feature alone among the methods that share it (data parallelism,
    # on at dp=2, carries every method's buckets)
    assert "test_sum" in on and not {"herring", "byteps", "parallax"} & set(on)
