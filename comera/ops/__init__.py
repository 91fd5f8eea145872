"""Python side of the comera operators: fakes (for torch.compile) and
autograd registrations.  Importing this module loads the compiled library."""
from comera.ops.embedding import tt_embedding, tt_embedding_plan
from comera.ops.linear import tt_linear
from comera.ops.linear_plan import tt_linear_plan
from comera.ops.gate_prox import gate_prox_
from comera.ops.gate_step import gate_step_

__all__ = ["tt_linear", "tt_linear_plan", "tt_embedding", "tt_embedding_plan", "gate_prox_",
           "gate_step_"]
