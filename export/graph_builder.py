"""Write ONNX graphs by hand, one operator a line: the builder behind `pipeline.onnx`.

    g = GraphBuilder()
    doubled = g.Mul(x, g.const(2.0))             # any ONNX operator, by its name
    top, index = g.TopK(values, k, outputs=2)    # several outputs
    (final,) = g.loop(limit, [(start, FLOAT)], body)  # a Loop whose body is a Python function
    (result,) = g.cond(flag, [FLOAT], then, otherwise)  # an If, each branch a Python function

Each call appends one node and returns the name(s) of its output(s), so a graph reads like the
NumPy it mirrors. Names are made unique across the graph and its subgraphs (ONNX wants one
name per value in the whole model).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18  # ScatterElements' max reduction and the axes of ReduceMax as an input need 18
IR_VERSION = 9  # what onnxruntime 1.16 and newer load

FLOAT, DOUBLE, INT64, BOOL, UINT8 = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64,
                                    TensorProto.BOOL, TensorProto.UINT8)


class GraphBuilder:
    """Nodes of one graph (or subgraph) and the names of its values."""

    def __init__(self, counter: Iterator | None = None):
        self.nodes: list[onnx.NodeProto] = []
        self._counter = counter or itertools.count()
        self._messages: dict[str, int] = {}

    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._counter)}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None, **attributes: Any):
        """Append one node; its output name, or a tuple of names when `outputs` > 1. `name`
        names the node (onnxruntime quotes it in the error when the node fails)."""
        results = [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), results, name=name or results[0], **attributes))
        return results[0] if outputs == 1 else tuple(results)

    def __getattr__(self, op_type: str) -> Callable[..., Any]:
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **options: self.op(op_type, *inputs, **options)

    def const(self, value: Any, dtype: type | None = None) -> str:
        """A constant tensor: floats as float32 and ints as int64 unless `dtype` says otherwise."""
        array = np.asarray(value, dtype=dtype)
        if dtype is None and array.dtype == np.float64:
            array = array.astype(np.float32)
        name = self.fresh("const")
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(array, name)))
        return name

    def subgraph(self, name: str, inputs: Sequence[tuple[str, int, list | None]],
                 outputs: Sequence[tuple[str, int]]) -> onnx.GraphProto:
        """This builder's nodes as a graph with typed inputs [(value name, element type, shape)]
        and outputs [(value name, element type)]."""
        return helper.make_graph(self.nodes, name,
                                 [helper.make_tensor_value_info(*value) for value in inputs],
                                 [helper.make_tensor_value_info(value, kind, None) for value, kind in outputs])

    def loop(self, limit: str, state: Sequence[tuple[str, int]], body: Callable[..., tuple],
             scans: Sequence[int] = ()) -> list[str]:
        """Run `body` until it returns False or `limit` times: state [(value, element type)] in,
        body(g, state, step) -> (go on: a bool, the new state, [one value per scan]); the final
        state out, then for each element type in `scans` the values of every turn, stacked."""
        inner = GraphBuilder(self._counter)
        step, go_in = inner.fresh("step"), inner.fresh("go_in")
        names = [inner.fresh("state") for _ in state]
        go_on, new_state, *scanned = body(inner, names, step)
        scanned = scanned[0] if scanned else []
        kinds = [kind for _, kind in state]
        outputs = [inner.Identity(value) for value in (go_on, *new_state, *scanned)]  # body outputs are own values
        graph = inner.subgraph(self.fresh("loop_body"), [(step, INT64, []), (go_in, BOOL, []),
                                                         *((name, kind, None) for name, kind in zip(names, kinds))],
                               list(zip(outputs, [BOOL, *kinds, *scans])))
        count = len(state) + len(scans)
        results = self.op("Loop", limit, self.const(True), *(value for value, _ in state), outputs=count, body=graph)
        return [results] if count == 1 else list(results)

    def cond(self, condition: str, kinds: Sequence[int], then: Callable[["GraphBuilder"], list[str]],
             otherwise: Callable[["GraphBuilder"], list[str]]) -> list[str]:
        """An If: each branch is a function g -> its outputs (of element types `kinds`)."""
        branches = []
        for branch in (then, otherwise):
            inner = GraphBuilder(self._counter)
            outputs = [inner.Identity(value) for value in branch(inner)]
            branches.append(inner.subgraph(self.fresh("branch"), [], list(zip(outputs, kinds))))
        results = self.op("If", condition, outputs=len(kinds), then_branch=branches[0], else_branch=branches[1])
        return [results] if len(kinds) == 1 else list(results)

    def guard(self, value: str, ok: str, message: str) -> str:
        """`value` once the bool `ok` holds; else the run stops with onnxruntime's error, which
        quotes the failing node's name: `message`, the one line an app can show."""
        index = self.Cast(self.Not(ok), to=INT64)
        uses = self._messages[message] = self._messages.get(message, 0) + 1  # node names are unique
        name = message if uses == 1 else f"{message} (check {uses})"
        zero = self.op("Gather", self.const([0.0]), self.Reshape(index, self.const([1])), name=name)
        return self.Add(value, self.CastLike(self.ReduceSum(zero, keepdims=0), value))

    def without_unused(self, outputs: Sequence[str]) -> None:
        """Drop the nodes whose outputs nothing reads (constants a step made and did not need),
        so runtimes don't warn about them; subgraphs count as readers of what they name."""
        while True:
            read = set(outputs) | {name for node in self.nodes for name in _read_names(node)}
            kept = [node for node in self.nodes if any(name in read for name in node.output)]
            if len(kept) == len(self.nodes):
                return
            self.nodes = kept

    def model(self, inputs: Sequence[onnx.ValueInfoProto], outputs: Sequence[onnx.ValueInfoProto],
              name: str) -> onnx.ModelProto:
        self.without_unused([value.name for value in outputs])
        graph = helper.make_graph(self.nodes, name, list(inputs), list(outputs))
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                                  producer_name="vit_hub")
        onnx.checker.check_model(proto, full_check=True)
        return proto


def _read_names(node: onnx.NodeProto) -> set[str]:
    """Every value a node reads, its subgraphs' reads included."""
    names = set(node.input)
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            for inner in attribute.g.node:
                names |= _read_names(inner)
            names |= {value.name for value in attribute.g.output}
    return names


# Constants, sizes and indices -----------------------------------------------------------------------
def dims(g: GraphBuilder, plane: str) -> tuple[str, str]:
    """(height, width) of a 2-D tensor, as int64 scalars."""
    shape = g.Shape(plane)
    return tuple(g.Squeeze(g.Slice(shape, g.const([axis]), g.const([axis + 1])), g.const([0])) for axis in (0, 1))


def vector(g: GraphBuilder, *scalars: str) -> str:
    """int64 scalars -> a 1-D shape tensor."""
    return g.Concat(*(g.Unsqueeze(scalar, g.const([0])) for scalar in scalars), axis=0)


def as_double(g: GraphBuilder, value: str) -> str:
    return g.Cast(value, to=DOUBLE)


def positions(g: GraphBuilder, size: str, kind: int = DOUBLE) -> str:
    """0, 1, ..., size - 1 as a 1-D tensor of `kind`."""
    return g.Cast(g.Range(g.const(0), size, g.const(1)), to=kind)


def grid(g: GraphBuilder, height: str, width: str, kind: int = DOUBLE) -> tuple[str, str]:
    """Row and column indices [h, w] (np.indices)."""
    rows = g.Unsqueeze(positions(g, height, kind), g.const([1]))  # [h, 1]
    cols = g.Unsqueeze(positions(g, width, kind), g.const([0]))  # [1, w]
    zeros = g.Mul(g.Add(rows, cols), g.CastLike(g.const(0), rows))  # [h, w]
    return g.Add(zeros, rows), g.Add(zeros, cols)


def f64(g: GraphBuilder, value: float) -> str:
    return g.const(float(value), np.float64)
