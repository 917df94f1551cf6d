"""What the planner tries for DDP: one layout, with or without whole-layer recomputation."""


def layouts(model, gpus, gpus_per_node, fixed, axis):
    yield dict(tp=1, pp=1, vpp=1, cp=1, ep=1)


def recompute_options():
    return [dict(recompute="none"), dict(recompute="full")]


def label(plan):
    return ["replicated"]


def sharding_text(plan):
    return "replicated"
