"""Generated protobuf and gRPC stubs of the pdserve.v1 API (run `make protos` after editing protos/)."""
