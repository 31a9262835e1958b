"""Generated code of the kvguard.v1 protobuf package lives in v1/."""
