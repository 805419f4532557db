"""Module: a frozen dataclass of static hyperparameters with ``init`` and ``__call__``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ._compose import (
    call_in_frame,
    children_of,
    derived_init,
    derived_init_state,
    derived_param_axes,
    derived_stateful,
    derived_uses_key,
    is_child,
    params_name,
)
from ._mode import manual_active
from ._params import ParamsDict
from ._precision import precision_dtype

__all__ = ["Module", "ParamsMismatchError"]


class ParamsMismatchError(ValueError):
    """Params that do not fit their module: ``Linear(5, 7): params /W has shape (5, 9),
    expected (5, 7)``. ``path`` is relative to ``owner``; a parent layer re-raises it with
    its own name and the full path (see ``Module.params_scope``)."""

    def __init__(self, owner: str, path: str, problem: str):
        self.owner, self.path, self.problem = owner, path, problem
        super().__init__(f"{owner}: params {path or '/'} {problem}")


ParamsMismatchError.__module__ = "nnlite"  # its public home, shown in tracebacks


class Module:
    """Base class for layers: hyperparameters only, parameters live in a ParamsDict.

    Subclasses are turned into frozen dataclasses automatically, so they are hashable and
    can be closed over or passed as static arguments to ``jax.jit``. Lists given for fields
    are stored as tuples; arrays are refused (they belong in the ParamsDict).

    Children are declared once, in ``setup()`` (run after the fields are set; assign
    modules, lists or dicts of modules) or as fields holding modules. A child's params
    nest under its attribute name (``self.blocks_``, with Python's trailing underscore,
    under ``blocks``: a child may share a field's name). Then ``init(key)`` is
    derived (one key per child with params, in declaration order, a lone child taking the
    key itself; params nested by the child's name), ``uses_key`` is derived (a child that takes a key), and so is
    ``init_state()`` (a child with state, such as ``BatchNorm``): the call then takes
    ``state=``/``train=`` and returns ``(out, new_state)`` without the module's own code
    threading either. A module that wraps one child sets the class attribute ``params_of``
    to the child's name: its params are then the child's own (``/W``, not ``/linear/W``),
    the key passed as is. Writing ``init`` by hand keeps working; both styles mix.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> class MLP(Module):
        ...     features: int
        ...     def setup(self):
        ...         from nnlite import Dropout, Linear
        ...         self.fc1 = Linear(self.features, 8)
        ...         self.drop = Dropout(0.1)
        ...         self.fc2 = Linear(8, 2)
        ...     def __call__(self, params, x):
        ...         h = self.drop(jax.nn.relu(self.fc1(params.fc1, x)))
        ...         return self.fc2(params.fc2, h)
        >>> mlp = MLP(3)
        >>> p = jax.jit(mlp.init)(jax.random.key(0))
        >>> p.print()
        /fc1/W: f32[3,8]
        /fc1/b: f32[8]
        /fc2/W: f32[8,2]
        /fc2/b: f32[2]
        >>> mlp.uses_key  # derived from the Dropout
        True
        >>> jax.jit(mlp)(p, jnp.ones((4, 3)), key=jax.random.key(1)).shape  # the key reaches drop
        (4, 2)

    A layer with its own arrays writes ``init`` by hand:

        >>> class Scale(Module):
        ...     features: int
        ...     def init(self, key):
        ...         return ParamsDict(s=jnp.ones(self.features))
        ...     def __call__(self, params, x, *, key=None):
        ...         self.check_input(x, self.features)
        ...         return x * jnp.broadcast_to(params.s, x.shape)  # no implicit rank promotion
        >>> layer = Scale(3)
        >>> p = layer.init(jax.random.key(0))
        >>> layer(p, jnp.ones((2, 3))).shape
        (2, 3)
    """

    #: False for layers without params (pools, activations, Flatten, Dropout): they are
    #: called as ``layer(x)`` (``layer(None, x)`` too) and add nothing to a parent's params.
    has_params: ClassVar[bool] = True
    #: The name of the one child whose params are this module's own, not nested under its
    #: name: a layer that wraps another (``RNN.cell``, ``SoftmaxHead.linear``). None: nested.
    params_of: ClassVar[str | None] = None
    _nnlite_module: ClassVar[bool] = True  # what _compose recognises a child by

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        cls.__setattr__ = _setup_setattr  # type: ignore[method-assign]
        dataclass_init = cls.__init__

        @functools.wraps(dataclass_init)
        def __init__(self, *args, **kwargs):
            dataclass_init(self, *args, **kwargs)
            if type(self) is cls:
                _run_setup(self)

        cls.__init__ = __init__  # type: ignore[method-assign]
        if cls.init is Module.init and cls.setup is not Module.setup:
            # A class of its own (models/contract refuses a model whose init is Module.init,
            # i.e. one that neither declares children nor writes init).
            def init(self, key: jax.Array) -> ParamsDict:
                """Fresh params, derived from the children declared in ``setup()``."""
                return derived_init(self, key)

            init._nnlite_derived = True  # type: ignore[attr-defined]
            cls.init = init  # type: ignore[method-assign]
        call = cls.__dict__.get("__call__")
        if call is not None and not getattr(call, "_scoped", False):
            # Each call runs in a frame (keys, state and error locations for the children,
            # see _compose.py); in manual-gradient mode it is also a named scope, so a
            # param-dependent op without a hand rule is reported with its layer.
            @functools.wraps(call)
            def scoped_call(self, *args, **kwargs):
                if not manual_active():
                    return call_in_frame(self, call, args, kwargs)
                with jax.named_scope(type(self).__name__):
                    return call_in_frame(self, call, args, kwargs)

            scoped_call._scoped = True  # type: ignore[attr-defined]
            scoped_call._nnlite_call = call  # type: ignore[attr-defined]
            cls.__call__ = scoped_call

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                object.__setattr__(self, f.name, tuple(v))
            elif isinstance(v, (jax.Array, np.ndarray)):
                raise TypeError(
                    f"{type(self).__name__}.{f.name}: modules hold hyperparameters, not arrays; "
                    "put arrays in the ParamsDict returned by init()"
                )

    def setup(self) -> None:
        """Declare children here (``self.fc = nl.Linear(...)``); runs once, after the fields
        are set and checked. The default declares none."""

    def init(self, key: jax.Array) -> ParamsDict:
        """Fresh parameters for this module: derived from its children unless written."""
        return derived_init(self, key)

    init._nnlite_derived = True  # type: ignore[attr-defined]

    @property
    def uses_key(self) -> bool:
        """Whether a call draws random numbers (dropout): derived, true when a child does.
        A layer that draws them itself overrides it; a model may set ``uses_key = True``."""
        d = self.__dict__
        if "_nnlite_uses_key" not in d:
            object.__setattr__(self, "_nnlite_uses_key", derived_uses_key(self))
        return d["_nnlite_uses_key"]

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails. ``init_state`` exists exactly when a child
        # has state, so "the model defines init_state" stays the test of a stateful model.
        d = object.__getattribute__(self, "__dict__")
        if name == "init_state" and d.get("_nnlite_ready") and derived_stateful(self):
            return functools.partial(derived_init_state, self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        raise NotImplementedError(f"{type(self).__name__} does not define __call__(params, x)")

    def check_input(self, x: Any, features: int, *, min_rank: int = 1) -> None:
        """Raise a ValueError naming this module unless ``x`` is a numeric array of rank at
        least ``min_rank`` whose last axis is ``features``."""
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < max(min_rank, 1) or shape[-1] != features:
            rank = f" and rank >= {min_rank}" if min_rank > 1 else ""
            raise ValueError(
                f"{self._short_repr()}: expected input with last axis {features}{rank}, got "
                f"shape {tuple(shape) if shape is not None else type(x).__name__}"
            )
        self.check_numeric(x)

    def check_numeric(self, x: Any) -> None:
        """Raise a ValueError naming this module unless ``x`` has a numeric dtype."""
        dtype = getattr(x, "dtype", None)
        if dtype is None or not (
            jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
        ):
            raise ValueError(
                f"{self._short_repr()}: expected a numeric array, got dtype {dtype} "
                f"(shape {getattr(x, 'shape', None)})"
            )

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of this module's own array leaves (``{"W": (5, 7), "b": (7,)}``); children's
        params are checked by the children. Layers with params override this."""
        return {}

    def param_axes(self) -> ParamsDict | None:
        """Logical axis names of each param dimension, for sharding: a tree like the
        params with an ``nl.Axes`` per array (``Linear``: ``W: ("in", "out")``), or None
        (the default): not declared, and a parallel strategy falls back to its own rule.
        Read it through ``nl.param_axes(module)``, which fills in undeclared layers. A
        module whose ``init`` is derived from its children derives this too: each child's
        declaration under the child's name."""
        if getattr(type(self).init, "_nnlite_derived", False) and children_of(self):
            return derived_param_axes(self)
        return None

    def check_params(self, params: Any, expected: Mapping[str, tuple] | None = None) -> None:
        """Check that ``params`` holds each leaf of ``expected`` (default:
        ``param_shapes()``) with that shape and this module's ``param_dtype``. Shapes are
        static, so under ``jit`` this runs once, at trace time, and costs nothing per step.

        Example:
            >>> import jax.numpy as jnp
            >>> from nnlite import Linear
            >>> Linear(5, 7)(ParamsDict(W=jnp.zeros((5, 9)), b=jnp.zeros(9)), jnp.ones(5))
            Traceback (most recent call last):
            ...
            nnlite.ParamsMismatchError: Linear(5, 7): params /W has shape (5, 9), expected (5, 7)
        """
        owner = self._args_repr()
        if not isinstance(params, Mapping | ParamsDict):
            raise ParamsMismatchError(
                owner, "", f"must be a ParamsDict from init(), got {type(params).__name__}"
            )
        want_dtype = jnp.dtype(getattr(self, "param_dtype", "float32"))
        expected = self.param_shapes() if expected is None else expected
        for name, shape in expected.items():
            if name not in params:
                keys = ", ".join(params) or "(none)"
                raise ParamsMismatchError(owner, f"/{name}", f"is missing (keys: {keys})")
            leaf = params[name]
            got = tuple(getattr(leaf, "shape", ()))
            if got != tuple(shape):
                raise ParamsMismatchError(
                    owner, f"/{name}", f"has shape {got}, expected {tuple(shape)}"
                )
            dtype = getattr(leaf, "dtype", None)
            if (
                dtype is not None
                and jax.dtypes.canonicalize_dtype(dtype) != want_dtype
                and jnp.dtype(dtype) != precision_dtype()  # cast by nl.precision's policy
            ):
                raise ParamsMismatchError(
                    owner,
                    f"/{name}",
                    f"has dtype {jnp.dtype(dtype)}, expected {want_dtype} (the module's "
                    "param_dtype; cast the params or build the module with that param_dtype)",
                )

    def child(self, params: Any, name: str) -> Any:
        """``params[name]``, or a ``ParamsMismatchError`` naming the missing path."""
        try:
            return params[name]
        except (KeyError, TypeError, IndexError):
            keys = ", ".join(params) if isinstance(params, Mapping | ParamsDict) else "(none)"
            raise ParamsMismatchError(
                self._args_repr(), f"/{name}", f"is missing (keys: {keys or '(none)'})"
            ) from None

    @contextlib.contextmanager
    def params_scope(self, path: str) -> Iterator[None]:
        """Calls to a child layer inside this block report params mismatches with this
        module's name and the full path (``FFN(...): params /layers[1]/W has shape ...``)."""
        try:
            yield
        except ParamsMismatchError as e:
            problem = e.problem if e.path else f"{e.problem} (in {e.owner})"
            new = ParamsMismatchError(self._args_repr(), path + e.path, problem)
            if hasattr(e, "_nnlite_where"):  # where the user's code made the call
                new._nnlite_where = e._nnlite_where  # type: ignore[attr-defined]
            raise new from None

    def compute_dtype(self, *arrays: Any) -> Any:
        """The dtype to compute in: the ``dtype`` field if set, else what the inputs and
        params promote to (as Flax's ``promote_dtype``)."""
        dtype = getattr(self, "dtype", None)
        if dtype is not None:
            return jnp.dtype(dtype)
        return jnp.result_type(*arrays)

    def _check_positive_ints(self, *names: str, allow_zero: bool = False) -> None:
        for name in names:
            v = getattr(self, name)
            values = v if isinstance(v, tuple) else (v,)
            lo = 0 if allow_zero else 1
            if not values or not all(
                isinstance(i, int | np.integer) and not isinstance(i, bool) and i >= lo
                for i in values
            ):
                kind = "non-negative" if allow_zero else "positive"
                what = f"a {kind} int" if not isinstance(v, tuple) else f"{kind} ints"
                raise ValueError(f"{type(self).__name__}: {name} must be {what}, got {v!r}")

    def _check_dtypes(self) -> None:
        """Validate the ``param_dtype`` and ``dtype`` fields: floating dtype names."""
        for name in ("param_dtype", "dtype"):
            v = getattr(self, name, None)
            if v is None and name == "dtype":
                continue
            try:
                ok = jnp.issubdtype(jnp.dtype(v), jnp.floating)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"{type(self).__name__}: {name} must name a floating dtype "
                    f"('float32', 'bfloat16', 'float16', ...), got {v!r}"
                )

    def _short_repr(self) -> str:
        fields = [f for f in dataclasses.fields(self) if f.name in ("in_features", "features")]
        inner = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields)
        return f"{type(self).__name__}({inner})"

    def _args_repr(self) -> str:
        """``Linear(5, 7)``: the required fields, positionally."""
        req = [
            f
            for f in dataclasses.fields(self)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        inner = ", ".join(repr(getattr(self, f.name)) for f in req)
        return f"{type(self).__name__}({inner})"


def _run_setup(module: Module) -> None:
    d = module.__dict__
    if type(module).setup is not Module.setup:
        object.__setattr__(module, "_nnlite_setup_children", {})
        object.__setattr__(module, "_nnlite_in_setup", True)
        try:
            module.setup()
        finally:
            object.__setattr__(module, "_nnlite_in_setup", False)
    d["_nnlite_ready"] = True


def _setup_setattr(self: Module, name: str, value: Any) -> None:
    """Assignments are allowed inside ``setup()`` only (the dataclass is frozen)."""
    d = self.__dict__
    owner = type(self).__name__
    if not d.get("_nnlite_in_setup"):
        raise dataclasses.FrozenInstanceError(
            f"cannot assign to field {name!r} ({owner} is frozen; declare children in setup())"
        )
    if name in {f.name for f in dataclasses.fields(self)}:
        raise AttributeError(
            f"{owner}.setup: {name!r} is a field of {owner}; give the child another name "
            f"(self.{name}_ nests its params under {name!r})"
        )
    if isinstance(getattr(type(self), name, None), property):
        # A subclass overrides this child with a property: the property's value is the
        # child (the assignment in the base class's setup gives way to it).
        value = getattr(self, name)
        d["_nnlite_setup_children"].pop(params_name(name), None)
        if is_child(value):
            d["_nnlite_setup_children"][params_name(name)] = value
        return
    if isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(
            f"{owner}.setup: self.{name} is an array; modules hold hyperparameters and "
            "children, arrays belong in the ParamsDict returned by init()"
        )
    if isinstance(value, list):
        value = tuple(value)
    object.__setattr__(self, name, value)
    children = d["_nnlite_setup_children"]
    children.pop(params_name(name), None)
    if is_child(value):
        children[params_name(name)] = value
