"""Objects a Python caller passes where a config names things (TRL's way): a reward function or
an environment put in the config itself, or passed to ``train(env=...)``."""

from __future__ import annotations

import copy

from tether.core.text import shown
from tether.models.callables import PASSED_FROM_PYTHON, python_object_spec
from tether.run.config import Config


def passed_objects(
    config: Config, *, scorer, env, tools=None, environment_factory=None
) -> tuple[Config, object, object]:
    """The config with its objects replaced by their names, and the objects: ``(config, scorer,
    env)``.

    A reward function (or a list holding one) set as ``config.reward.scorer`` becomes the run's
    scorer and leaves ``reward.scorer`` unset (config.yaml then names it, as
    :func:`tether.run.setup.python_scorer_spec` writes it). An environment given as
    ``config.rollout.env`` or ``train(env=...)`` is named in ``rollout.env``, so that a resume asks
    for it again. Tools (``train(tools=[...])`` or functions put in
    ``config.rollout.tools``) become the environment (:class:`tether.models.tools.ToolEnv`), named
    in ``rollout.tools``. The config is copied before its objects are replaced, the objects themselves kept
    (a tool client holding a lock or a socket cannot be deep-copied, and need not be).

    Args:
        config: as the caller built it (not changed).
        scorer: the ``scorer`` (or ``reward_funcs``) passed to ``train``, or None.
        env: the ``env`` passed to ``train``, or None.
        tools: the ``tools`` passed to ``train`` (functions), or None.
        environment_factory: TRL's ``environment_factory`` passed to ``train`` (a class), or None;
            also from ``config.rollout.environment_factory`` as an object. It becomes the
            environment (:class:`tether.models.tools.FactoryEnv`), with the tools beside it.

    Raises:
        ValueError: both ``train(env=...)`` and a ``rollout.env`` name give the environment, both
            ``train(tools=...)`` and ``rollout.tools`` give tools, tools beside an environment, or
            ``env`` is not callable; a tool that cannot be described
            (:func:`tether.models.tools.tool_schema`).
    """
    spec, given = config.reward.scorer, config.rollout.env
    objects = [spec, given, *(spec if isinstance(spec, list) else [])]
    keep = {id(x): x for x in objects if callable(x)}
    if scorer is None and (callable(spec) or (isinstance(spec, list) and any(callable(x) for x in spec))):
        # a TRL user's reward_funcs put in the config: the objects are the scorer
        scorer, config = spec, copy.deepcopy(config, dict(keep))
        config.reward.scorer = None
    if callable(given) or env is not None:
        if env is not None and given is not None and not str(given).startswith(PASSED_FROM_PYTHON):
            raise ValueError(
                f"train(env=...) and rollout.env={shown(given)} both give the environment; give one of them"
            )
        env = given if callable(given) else env
        if not callable(env):
            raise ValueError(f"train(env=...) takes a callable, got a {type(env).__name__}")
        config = copy.deepcopy(config, dict(keep))
        config.rollout.env = python_object_spec(env)
    listed = config.rollout.tools if isinstance(config.rollout.tools, list) else []
    named = config.rollout.environment_factory
    if environment_factory is not None or callable(named):
        from tether.models.tools import FactoryEnv, load_tools, tool_specs

        if (
            environment_factory is not None
            and named is not None
            and not str(named).startswith(PASSED_FROM_PYTHON)
        ):
            raise ValueError(
                f"train(environment_factory=...) and rollout.environment_factory={shown(named)} both give "
                "it; give one of them"
            )
        if env is not None:
            raise ValueError(
                "train(environment_factory=...) and an environment (env=..., rollout.env) both answer the "
                "policy's turns; give one"
            )
        factory = environment_factory if environment_factory is not None else named
        passed = list(tools) if tools is not None else [t for t in listed if callable(t)]
        standalone = passed or (list(load_tools(listed).tools.values()) if listed else [])
        env = FactoryEnv(factory, standalone)
        config = copy.deepcopy(config, {id(factory): factory, **{id(t): t for t in standalone}})
        config.rollout.environment_factory = python_object_spec(factory)
        if passed:
            config.rollout.tools = tool_specs(passed)
        return config, scorer, env
    if tools is not None or any(callable(t) for t in listed):
        from tether.models.tools import ToolEnv, tool_specs

        if tools is not None and listed and not all(str(t).startswith(PASSED_FROM_PYTHON) for t in listed):
            raise ValueError(
                f"train(tools=...) and rollout.tools={shown(listed)} both give the tools; give one of them"
            )
        if env is not None:
            raise ValueError(
                "train(tools=...) and an environment (env=..., rollout.env) both answer the policy's "
                "turns; give one"
            )
        tools = list(tools if tools is not None else listed)
        if not all(callable(t) for t in tools):
            raise ValueError(
                "train(tools=...) takes functions (typed, with Google-style docstrings), as TRL's tools=[...]"
            )
        env = ToolEnv(tools)
        config = copy.deepcopy(config, {id(t): t for t in tools})
        config.rollout.tools = tool_specs(tools)
    return config, scorer, env
