"""Suite bodies on the tiny model, as the tests write them before a test adds or overrides its own fields."""


def tiny_suite(kind: str, **fields) -> dict:
    """A `kind` suite on the tiny model comparing `full` with Scissorhands; `fields` add to it or override."""
    return {"kind": kind, "model": "tiny-llama", "policies": ["full", "scissorhands"], **fields}


def serving_suite(**fields) -> dict:
    """A serving suite (`tiny_suite`) on one replica, seed 0, without warm-up requests."""
    return tiny_suite("serving", **{"warmup_requests": 0, "seed": 0, "replicas": 1, **fields})


def uniform(low: int, high: int) -> dict:
    """A token length drawn uniformly from `low` to `high` (a serving suite's prompt or new tokens)."""
    return {"dist": "uniform", "min": low, "max": high}


def tiny_batch(**fields) -> dict:
    """A batch suite of 6 points on 2 replicas (`full` at batch 1 and 4, Scissorhands at ratios 2 and 5 for each), a
    new dict each call; `fields` add to it or override."""
    suite = dict(name="tiny", compression_ratios=[2, 5], batch_sizes=[1, 4], prompt_tokens=[64], new_tokens=[16])
    return tiny_suite("batch", **{**suite, "seed": 0, "replicas": 2, **fields})
