"""The pipeline's stages (design §5) and reconcilers (design §6), one module each, read
top to bottom like the design's algorithm: a plain ``handle_<stage>(payload, ctx)`` holds
the logic and the delivery runtime (`streams.runtime`) runs it. `pipeline` lists them;
`deps` is what they share; `kit` the helpers they have in common."""
