"""A gradient sink and weight-gradient makers that record what the layers hand them: the
counterparts of moe_ddp's sink and moe_model's makers, without either package."""

import torch


class RecordingSink:
    """A GradientSink with FP32 accumulators for the weights it accepts."""

    def __init__(self, params):
        self.targets = {id(p): torch.zeros(p.numel()) for p in params}
        self.calls = 0

    def accepts(self, param):
        return id(param) in self.targets

    def add_gradient(self, param, add):
        add(self.targets[id(param)])
        self.calls += 1


class LaterGradient:
    """A grouped weight-gradient maker's add (the layers' ``weight_gradient``): records its
    operands and adds ``x_e^T @ dy_e`` per expert, in the weight's storage order, when called."""

    made: list = []

    def __init__(self, x, dy, offsets, like):
        self.x, self.dy, self.offsets, self.like = x, dy, offsets, like
        LaterGradient.made.append(self)

    def __call__(self, target):
        dw = torch.zeros(self.like.shape)
        start = 0
        for e, end in enumerate(self.offsets.tolist()):
            dw[e] = self.x[start:end].T.float() @ self.dy[start:end].float()
            start = end
        assert self.like.transpose(1, 2).is_contiguous()  # [E, K, N] view of an [E, N, K] weight
        target.add_(dw.transpose(1, 2).reshape(-1))


class LaterDense:
    """A dense weight-gradient maker's add (the layers' ``dense_weight_gradient``): records
    its operands and adds ``dy^T @ x`` to the target when called."""

    made: list = []

    def __init__(self, x, dy):
        self.x, self.dy = x, dy
        LaterDense.made.append(self)

    def __call__(self, target):
        target.add_((self.dy.T.float() @ self.x.float()).reshape(-1))
