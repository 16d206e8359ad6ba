"""The engine's hook points, and the registry of the plug-ins that use them.

The runtime runs plans; it knows nothing of what plugs into it. A plug-in (today one:
``ds_pipemorph.inject``, slow links, faults and slowed stages made on purpose) is an object that
registers itself with ``register_plugin`` when its package is imported, under the key of the
``pipemorph`` section it reads. ``ds_pipemorph/__init__`` imports the injection plug-in, so it is
registered before any runtime module runs, whichever entry point a job uses
(``ds_pipemorph.initialize``, ``PipeMorphEngine`` or ``build_transport``). Imports point one way:
the plug-in imports the runtime, the runtime never imports the plug-in (tests/install/test_layering.py).

A ``Plugin`` owns its section of the config: the runtime's ``PipeMorphConfig`` keeps the key and
hands its value to ``Plugin.model`` for validation (errors read as any other key's:
``ds_config pipemorph: unknown key 'inject.links.2.delay'``), ``Plugin.check`` for the rules that
involve other keys, and ``Plugin.check_job`` once the pipeline's size is known (the engine asks it
before DeepSpeed builds anything). What a plug-in does at run time goes through two kinds of hooks,
built per rank by ``Plugin.transport_hooks`` and ``Plugin.engine_hooks``:

- ``TransportHooks`` (``build_transport``, when a rank's link router is built): wrap the direct
  path (``wrap_direct``: delays, failing links), wrap the whole router (``wrap_router``: killing a
  delegate after a message), and hand the delegated path a ``DelaySource`` its sender delegates apply
  per message (the delegates are separate processes: the source must pickle its ``trace``);
- ``EngineHooks`` (``PipeMorphEngine``): ``start_iteration`` before the first instruction of each
  ``train_batch`` of the plan; ``after_op`` after the handler of each instruction type in ``ops``,
  inside the op's record (a wait there counts in the op's time, as a slower op would);
  ``migration_drop`` (migration attempts whose payload is never sent) and ``ready_refused`` (why
  ready dispatch cannot run with these hooks, or None). Tests and benchmarks add their own to a
  running engine with ``PipeMorphEngine.add_hooks``.

The engine composes ``after_op`` into the handlers of its compiled program once per plan (and
again when hooks are added): an instruction no hook asks for runs exactly its handler, and with no
hooks at all the program is the class's handlers, so the per-instruction loop pays nothing. The
class's ``_INSTRUCTION_MAP`` is never replaced on an instance.

Example (a hook that counts the forwards of a running engine)::

    class CountF(EngineHooks):
        ops = frozenset({instructions.ForwardPass})
        n = 0
        def after_op(self, engine, instruction, kwargs, started):
            self.n += 1

    engine.add_hooks(CountF())
"""
from __future__ import annotations

from time import perf_counter
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from pydantic import BaseModel


class DelayTrace(Protocol):
    def at(self, seconds: float) -> Sequence[float]:
        """The delay in ms of every link ``seconds`` after the trace's origin."""


class DelaySource(Protocol):
    """Injected one-way delays per link, as the delegated path reads them.

    ``static``: ms per link (may change while training: published again before each message);
    ``trace``: None, or a picklable ``DelayTrace`` replayed from ``origin`` (its delegates get a copy);
    ``origin``: the trace's t = 0 on ``time.monotonic`` (None until started); ``start()`` starts the
    trace's clock now unless it runs already and returns the origin. The router starts it at its
    first message operation, so both paths of a link replay the trace on one clock."""

    static: list[float]
    trace: Optional[DelayTrace]

    @property
    def origin(self) -> Optional[float]: ...

    def start(self) -> float: ...


class TransportHooks:
    """What a plug-in changes in one rank's link router (``build_transport``); the defaults change nothing.

    ``p2p_rules``: ``"nccl"`` when the direct path ``wrap_direct`` returns follows NCCL's
    point-to-point rules (a test double on gloo): the engine then lowers and dispatches as on the
    NCCL backend (``runtime.plans.lowering_for``)."""

    delays: Optional[DelaySource] = None
    p2p_rules: Optional[str] = None
    # False when the wrapped direct path issues sends or receives elsewhere than where the stream puts
    # them (a delay's lane sends later): NCCL's rules forbid it.
    keeps_issue_order: bool = True

    def wrap_direct(self, direct, *, rank: int, stage_id: int, timeout_s: float):
        """The direct path the router uses: ``direct`` or a ``protocol.Transport`` around it."""
        return direct

    def wrap_router(self, router):
        """What ``build_transport`` returns: ``router`` or a ``Transport`` and ``LinkControl`` around it."""
        return router


class EngineHooks:
    """What a plug-in does in one ``PipeMorphEngine`` (see the module docstring); the defaults do nothing."""

    ops: frozenset = frozenset()  # instruction types whose runs ``after_op`` follows
    migration_drop: frozenset = frozenset()  # migration attempts (0 = the first) whose payload is never sent
    ready_refused: Optional[str] = None  # one sentence: why dispatch "ready" cannot run with these hooks

    def start_iteration(self, engine) -> None:
        """Before the first instruction of each ``train_batch`` of the plan."""

    def after_op(self, engine, instruction: type, kwargs: dict, started: float) -> None:
        """After the handler of an instruction of type ``instruction`` (one of ``ops``) ran with
        ``kwargs``; ``started`` is ``time.perf_counter()`` when the handler began."""


class Hooks:
    """The engine hooks in force in one engine, in the order they were added."""

    def __init__(self, items: Iterable[EngineHooks]):
        self.items = tuple(items)
        self.migration_drop = frozenset().union(*(h.migration_drop for h in self.items))
        self.ready_refused = next((h.ready_refused for h in self.items if h.ready_refused), None)

    def start_iteration(self, engine) -> None:
        for h in self.items:
            h.start_iteration(engine)

    def around(self, handlers: dict) -> dict:
        """A new handler map: ``handlers`` with each instruction some hook asks for followed by its hooks."""
        out = dict(handlers)
        for instruction, handler in handlers.items():
            after = [h.after_op for h in self.items if instruction in h.ops]
            if after:
                out[instruction] = follow(instruction, handler, after)
        return out


def follow(instruction: type, handler: Callable, after: list[Callable]) -> Callable:
    """``handler`` (of instructions of type ``instruction``) followed by each ``after_op`` in ``after``;
    returns what the handler returns."""
    def run(engine, *args, **kwargs):
        started = perf_counter()
        out = handler(engine, *args, **kwargs)
        for hook in after:
            hook(engine, instruction, kwargs, started)
        return out

    run.__wrapped__ = handler
    run.__name__ = getattr(handler, "__name__", "handler")
    return run


class Plugin:
    """A plug-in of the runtime: the ``pipemorph`` section it reads and the hooks it builds.

    ``key`` names a section ``PipeMorphConfig`` keeps for plug-ins (``PLUGIN_SECTIONS``);
    ``model`` validates it (a ``config.SectionModel``: unknown keys refused, types checked, not
    converted); ``path_keys`` are the routes inside it that hold file paths (resolved as the
    section's other paths are); ``descriptions`` document its keys in docs/config.md (by dotted
    path, the section's key first: ``inject.links``)."""

    key: str = ""
    model: type[BaseModel] = BaseModel
    path_keys: tuple[tuple[str, ...], ...] = ()
    descriptions: dict[str, str] = {}

    def parse(self, section: Any) -> BaseModel:
        """The validated section (``None``: every key at its default); raises pydantic's ValidationError."""
        return self.model.model_validate({} if section is None else section)

    def check(self, settings, cfg) -> None:
        """Rules that involve the rest of the section ``cfg``: raise ValueError with one sentence."""

    def check_job(self, settings, stages: int) -> None:
        """Refuse, before the engine is built, settings a job of ``stages`` stages cannot use
        (``PipeMorphConfigError``, one sentence: a link or stage it lacks, a file it cannot read)."""

    def transport_hooks(self, settings, stages: int, engine=None) -> Optional[TransportHooks]:
        """The router hooks for ``settings`` in a pipeline of ``stages`` stages (None: none); ``engine``
        when a ``PipeMorphEngine`` builds its own router (None: a router built on its own)."""
        return None

    def engine_hooks(self, settings, engine) -> list[EngineHooks]:
        """The hooks of ``engine`` (its DeepSpeed part is built, its transport not yet)."""
        return []


# The sections of ``PipeMorphConfig`` whose value a registered plug-in validates.
PLUGIN_SECTIONS = ("inject",)

_PLUGINS: dict[str, Plugin] = {}


def register_plugin(plugin: Plugin) -> None:
    """Make ``plugin`` the one that reads section ``plugin.key`` (registering again replaces it)."""
    if plugin.key not in PLUGIN_SECTIONS:
        raise ValueError(f"a plug-in reads one of the sections {PLUGIN_SECTIONS}, not '{plugin.key}'")
    _PLUGINS[plugin.key] = plugin


def plugin(key: str) -> Optional[Plugin]:
    """The plug-in registered for section ``key``, None if none is."""
    return _PLUGINS.get(key)


def active_plugins(cfg) -> list[tuple[Plugin, Any]]:
    """(plug-in, its validated settings in ``cfg``, a ``PipeMorphConfig``) for every registered plug-in
    whose section ``cfg`` validated (one parsed before the plug-in was registered has none)."""
    return [(p, getattr(cfg, key)) for key, p in _PLUGINS.items() if getattr(cfg, key) is not None]


def transport_hooks(cfg, stages: int, engine=None) -> list[TransportHooks]:
    """The router hooks every registered plug-in gives for ``cfg`` in a pipeline of ``stages`` stages."""
    found = [p.transport_hooks(settings, stages, engine) for p, settings in active_plugins(cfg)]
    return [h for h in found if h is not None]
