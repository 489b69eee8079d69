"""Small helpers every phaselens part may import (it imports none of them): the listener exposure
policy, child-process helpers, the one quantile definition and the SLO syntax."""
