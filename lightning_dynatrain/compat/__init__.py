"""Private names of torch, megatron-core and Lightning, each in one place with the versions it was
checked on (see each function). The rest of the package calls these, never the private name."""
