#!/usr/bin/env python3
"""PyTorch Adam / AdamW optimiser state to and from the safetensors file that
``multihead::optim::AdamW::load_state`` reads and ``save_state`` writes.

As a command, for an ``optimizer.state_dict()`` saved with ``torch.save``::

    python3 tools/optim_state.py to-safetensors optimizer.pt optimizer.safetensors [--group 0]

writes one parameter group's state with PyTorch's positions as keys (``state.0.exp_avg``, the
positions counted within the group). For an optimiser whose parameters have names (the keys of
``multihead::optim::AdamW::from_varmap``), from Python::

    import optim_state
    names = {p: n for n, p in model.named_parameters()}
    optim_state.export_state(optimizer, "optimizer.safetensors", names=names)
    optim_state.import_state(optimizer, "optimizer.safetensors", names=names)  # and back

The file (docs/pytorch-behaviour.md, 7.9): ``state.{key}.step`` (0-dim f32),
``state.{key}.exp_avg``, ``state.{key}.exp_avg_sq`` and with ``amsgrad``
``state.{key}.max_exp_avg_sq`` for each parameter with state; ``param_groups.0.lr``,
``.betas`` (2 values), ``.eps``, ``.weight_decay`` (f64) and ``.amsgrad``, ``.maximize``,
``.decoupled_weight_decay`` (u8).
"""

import argparse
import sys

import torch
from safetensors.torch import load_file, save_file

ENTRIES = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _group_tensors(group, decoupled):
    out = {
        "lr": torch.tensor(float(group["lr"]), dtype=torch.float64),
        "betas": torch.tensor([float(b) for b in group["betas"]], dtype=torch.float64),
        "eps": torch.tensor(float(group["eps"]), dtype=torch.float64),
        "weight_decay": torch.tensor(float(group["weight_decay"]), dtype=torch.float64),
        "amsgrad": torch.tensor(int(bool(group.get("amsgrad", False))), dtype=torch.uint8),
        "maximize": torch.tensor(int(bool(group.get("maximize", False))), dtype=torch.uint8),
        "decoupled_weight_decay": torch.tensor(int(decoupled), dtype=torch.uint8),
    }
    return {f"param_groups.0.{k}": v for k, v in out.items()}


def _state_tensors(key, state):
    out = {}
    for entry in ENTRIES:
        if entry not in state:
            continue
        value = state[entry]
        if entry == "step":
            value = torch.tensor(float(value), dtype=torch.float32)
        out[f"state.{key}.{entry}"] = value.detach().contiguous().clone()
    return out


def _decoupled(optimizer_or_group, default):
    group = optimizer_or_group
    if "decoupled_weight_decay" in group:
        return bool(group["decoupled_weight_decay"])
    return default


def export_state(optimizer, path, names=None, group=0):
    """Writes parameter group ``group`` of a live ``torch.optim.Adam`` / ``AdamW``."""
    if not isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW):
        raise TypeError(f"expected torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
    g = optimizer.param_groups[group]
    decoupled = _decoupled(g, isinstance(optimizer, torch.optim.AdamW))
    out = _group_tensors(g, decoupled)
    for i, p in enumerate(g["params"]):
        state = optimizer.state.get(p)
        if not state:
            continue
        key = names[p] if names is not None else str(i)
        out.update(_state_tensors(key, state))
    save_file(out, str(path))


def import_state(optimizer, path, names=None, group=0):
    """Loads a file into parameter group ``group`` of a live ``torch.optim.Adam`` / ``AdamW``
    (its state replaced as ``load_state_dict`` replaces it). Every ``state.*`` key must name a
    parameter of the group with the parameter's shape; nothing is changed otherwise."""
    t = load_file(str(path))
    g = optimizer.param_groups[group]
    keys = {(names[p] if names is not None else str(i)): p for i, p in enumerate(g["params"])}
    states, problems = {}, []
    for name, value in t.items():
        if name.startswith("param_groups.0."):
            continue
        key, _, entry = name[len("state."):].rpartition(".") if name.startswith("state.") else ("", "", "")
        if entry not in ENTRIES or key not in keys:
            problems.append(f"{name}: not a state entry of this group's parameters"
                            + ("" if names is not None else " (a file keyed by name needs names=)"))
            continue
        p = keys[key]
        if entry != "step" and tuple(value.shape) != tuple(p.shape):
            problems.append(f"{name}: shape {tuple(value.shape)}, its parameter {tuple(p.shape)}")
            continue
        states.setdefault(p, {})[entry] = (value.to(torch.float32) if entry == "step"
                                           else value.to(p.dtype))
    for p, state in states.items():
        missing = [e for e in ("step", "exp_avg", "exp_avg_sq") if e not in state]
        if missing:
            problems.append(f"a parameter's state lacks {missing}")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    for k in ("lr", "eps", "weight_decay"):
        g[k] = float(t[f"param_groups.0.{k}"])
    g["betas"] = tuple(float(b) for b in t["param_groups.0.betas"])
    for k in ("amsgrad", "maximize"):
        g[k] = bool(int(t[f"param_groups.0.{k}"]))
    if "decoupled_weight_decay" in g:
        g["decoupled_weight_decay"] = bool(int(t["param_groups.0.decoupled_weight_decay"]))
    for p in g["params"]:
        if p in states:
            optimizer.state[p] = states[p]
        else:
            optimizer.state.pop(p, None)


def convert(state_dict, group=0, decoupled=True):
    """A saved ``optimizer.state_dict()``'s group ``group`` as the file's tensors, keyed by
    position within the group."""
    g = state_dict["param_groups"][group]
    if "betas" not in g:
        raise ValueError("not an Adam or AdamW state (its parameter group has no 'betas'); "
                         "multihead::optim::AdamW takes Adam's and AdamW's")
    out = _group_tensors(g, _decoupled(g, decoupled))
    for i, index in enumerate(g["params"]):
        state = state_dict["state"].get(index)
        if state:
            out.update(_state_tensors(str(i), state))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    to = sub.add_parser("to-safetensors", help="convert a torch.save'd optimizer.state_dict()")
    to.add_argument("optimizer_pt")
    to.add_argument("out")
    to.add_argument("--group", type=int, default=0, help="which parameter group (default 0)")
    to.add_argument("--adam", action="store_true",
                    help="the state is torch.optim.Adam's from a PyTorch without "
                         "decoupled_weight_decay (weight decay added to the gradient)")
    args = ap.parse_args(argv)
    try:
        sd = torch.load(args.optimizer_pt, map_location="cpu", weights_only=True)
    except Exception as e:  # a file torch.save did not write
        sys.exit(f"{args.optimizer_pt}: cannot be read by torch.load: {e}")
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        sys.exit(f"{args.optimizer_pt}: not an optimizer.state_dict() (no 'state' and 'param_groups')")
    if not 0 <= args.group < len(sd["param_groups"]):
        sys.exit(f"--group {args.group}: the state has {len(sd['param_groups'])} parameter groups")
    try:
        out = convert(sd, args.group, decoupled=not args.adam)
    except ValueError as e:
        sys.exit(f"{args.optimizer_pt}: {e}")
    save_file(out, args.out)
    n = sum(1 for k in out if k.endswith(".step"))
    print(f"wrote {len(out)} tensors ({n} parameters with state) to {args.out}")


if __name__ == "__main__":
    main()
