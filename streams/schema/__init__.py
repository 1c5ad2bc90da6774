"""The building blocks of Stovepipe's YAML files, shared by `streams.config` (the files)
and `streams.extensions` (each kind's spec): the value types their pydantic models are made
of, duration parsing, and one translation of validation errors into messages that name
the YAML path. Imports nothing else from Stovepipe."""
