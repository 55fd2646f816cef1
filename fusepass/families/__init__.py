"""The chain families fusepass fuses: each module declares a family's steps (its pattern) next to what
replaces a match (its replacement) and how explain() describes one."""

from fusepass.families import linear_batch_norm

FAMILIES = (linear_batch_norm.FAMILY,)
