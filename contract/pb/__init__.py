"""Generated protobuf modules (`*_pb2.py`, stubs `*_pb2.pyi`) for the `.proto` files here.

Do not edit the generated files: change the `.proto` and run `python -m contract.generate`.
"""
