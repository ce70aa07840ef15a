"""`verispec bench`: speed, acceptance and exactness of every method on one suite, against transformers."""
