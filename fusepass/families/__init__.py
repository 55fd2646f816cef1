"""The chain families fusepass fuses: each module declares a family's steps (its pattern) next to what
replaces a match (its replacement) and how explain() describes one. FAMILIES is in priority order: a
node belongs to the first family that matches it, so a linear heading a chain is the chain's, and the
bare-linear family takes only the linears left over."""

from fusepass.families import bare_linear, linear_batch_norm

FAMILIES = (linear_batch_norm.FAMILY, bare_linear.FAMILY)
