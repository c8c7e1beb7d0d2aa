"""A Run from the keywords `trainwise plan`'s flags use (seq_len, precision, gpu, gpus, tp, pp, zero, ...), for
tests that plan many layouts: the translation trainwise.plan(...) uses (trainwise.api.run_from_keywords)."""

from trainwise.api import run_from_keywords
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Run


def run_of(model=None, tokens: float | None = None, **keywords) -> Run:
    """The run of `model` the keywords describe (defaults: seq_len 2048, the bf16 recipe, one device)."""
    run, plan_keywords = run_from_keywords(Run(model, recipe=get_recipe("bf16")), tokens, keywords)
    assert not plan_keywords, f"give {sorted(plan_keywords)} to plan_run, not to the run"
    return run
