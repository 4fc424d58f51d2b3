"""The training manager: the ranks' status, the live training config's versions, the status rules
and the proposals they make."""
