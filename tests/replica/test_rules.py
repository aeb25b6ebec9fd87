"""The shared config rules (replica.common.rules): one error line per field, number checks, the config base."""

import pytest
from pydantic import ValidationError

from replica.common.rules import FrozenConfig, at_most_one, check_fraction, check_number, need_one_of
from replica.common.types import ConfigError, EngineConfig


@pytest.mark.parametrize("value", [-1, True, "2", float("inf"), float("nan"), None])
def test_check_number_names_the_field_and_the_bound(value):
    with pytest.raises(ValueError, match=rf"^num_cpus: expected a number >= 0, got {value!r}$".replace("(", r"\(")):
        check_number("num_cpus", value, 0)
    check_number("num_cpus", 0, 0)
    check_number("num_cpus", 2.5, 0)
    check_number("num_cpus", None, 0, optional=True)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "1"])
def test_check_fraction_accepts_only_zero_to_one(value):
    with pytest.raises(ValueError, match=r"^f: expected a number in \(0, 1\] or null, got "):
        check_fraction("f", value, optional=True)
    check_fraction("f", 1)
    check_fraction("f", 0.25)


def test_one_of_and_at_most_one_name_their_fields():
    class Obj:
        a, b = None, None

    with pytest.raises(ValueError, match="^a, b: give at least one bound$"):
        need_one_of(Obj(), "a", "b")
    obj = Obj()
    obj.a = obj.b = 1
    with pytest.raises(ValueError, match="^a, b: give one of them, not several$"):
        at_most_one(obj, "a", "b")
    obj.b = None
    at_most_one(obj, "a", "b")  # one given: accepted


class _Limits(FrozenConfig):
    prefix = "limits"
    low: int = 0
    high: int | None = None


def test_frozen_config_prefixes_every_field_it_names_and_lists_the_accepted_keys():
    with pytest.raises(ValueError, match=r"^limits\.color: unknown key \(accepted: low, high\)$"):
        _Limits(color=1)
    with pytest.raises(ValueError, match=r"^limits\.low: Input should be a valid integer.*, got 'x'$"):
        _Limits.parse({"low": "x"})
    with pytest.raises(ValueError, match=r"^limits: expected a mapping, got \[1\] \(list\)$"):
        _Limits.parse([1])
    cfg = _Limits.parse({"high": 3})
    assert (cfg.low, cfg.high) == (0, 3) and _Limits.parse(None) == _Limits() and _Limits.parse(cfg) is cfg
    with pytest.raises(ValidationError, match="frozen"):
        cfg.low = 1


def test_engine_config_is_frozen_round_trips_and_raises_one_line():
    cfg = EngineConfig(policy="scissorhands", compression_ratio=5, max_length_tokens=40)
    assert EngineConfig(**cfg.model_dump()) == cfg and cfg.resolved_budget_tokens() == 32  # ceil(40 / 5), floored
    with pytest.raises(ValidationError, match="frozen"):
        cfg.max_batch = 2
    with pytest.raises(ConfigError) as e:
        EngineConfig(max_batch=0, kv_memory_limit_bytes=-1, colour="red")
    assert str(e.value) == (
        "kv_memory_limit_bytes: expected an integer >= 1 or null, got -1; "
        "max_batch: expected an integer >= 1 or null, got 0; "
        "colour: unknown key (accepted: policy, policy_params, budget_tokens, compression_ratio, "
        "max_length_tokens, kv_memory_limit_bytes, kv_memory_fraction, kv_limit_full_sequences, max_batch, "
        "max_prefill_tokens, kv_layout, budget, block_tokens, scheduler, max_num_batched_tokens, engine, openvino_kv_precision, "
        "enable_prefix_caching, kv_reuse)"
    )
    assert isinstance(e.value, ValueError)


def test_one_line_names_list_items_and_leaves_a_rule_that_names_no_field_whole():
    """One formatter for configs and suites: list items as ``field[i]``, a rule naming its fields keeps them (with
    the prefix), and a message whose text before ``": "`` is not field names is placed under the default."""
    from pydantic import BaseModel, model_validator

    from replica.common.rules import one_line

    class Rule(BaseModel):
        xs: list[int] = []
        text: str = ""

        @model_validator(mode="after")
        def _rule(self):
            if self.text:
                raise ValueError(self.text)
            return self

    def line(prefix="", **kw):
        with pytest.raises(ValidationError) as e:
            Rule(**kw)
        return one_line(e.value, prefix, default="suite")

    assert line(xs=[1, "a"]) == "xs[1]: Input should be a valid integer, unable to parse string as an integer, got 'a'"
    assert line(text="a, b.c: give one") == "a, b.c: give one"
    assert line("placement", text="a, b.c: give one") == "placement.a, placement.b.c: give one"
    assert line(text="trace file not found: /x/a, b.jsonl") == "suite: trace file not found: /x/a, b.jsonl"
    assert line("placement", text="no bound: x") == "placement: no bound: x"
