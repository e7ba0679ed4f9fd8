"""The Open Inference Protocol's gRPC messages (package `inference`, as KServe v2 and
Triton's clients use them), from `proto/open_inference.proto`, in a descriptor pool of
their own: a process that also imports a client's generated modules of the same package
(tritonclient) has no clash, and no generated code pins a protobuf version.

`_DESCRIPTOR` is the compiled proto (a serialized FileDescriptorProto). After an edit
of the proto, `tests/serving/test_v2_grpc.py` names the new value (it compiles the
proto with grpcio-tools and compares).
"""

from __future__ import annotations

import base64

from google.protobuf import descriptor_pool, message_factory

_DESCRIPTOR = base64.b64decode(
    "ChRvcGVuX2luZmVyZW5jZS5wcm90bxIJaW5mZXJlbmNlIhMKEVNlcnZlckxpdmVSZXF1ZXN0IiIKElNlcnZl"
    "ckxpdmVSZXNwb25zZRIMCgRsaXZlGAEgASgIIhQKElNlcnZlclJlYWR5UmVxdWVzdCIkChNTZXJ2ZXJSZWFk"
    "eVJlc3BvbnNlEg0KBXJlYWR5GAEgASgIIjIKEU1vZGVsUmVhZHlSZXF1ZXN0EgwKBG5hbWUYASABKAkSDwoH"
    "dmVyc2lvbhgCIAEoCSIjChJNb2RlbFJlYWR5UmVzcG9uc2USDQoFcmVhZHkYASABKAgiFwoVU2VydmVyTWV0"
    "YWRhdGFSZXF1ZXN0IksKFlNlcnZlck1ldGFkYXRhUmVzcG9uc2USDAoEbmFtZRgBIAEoCRIPCgd2ZXJzaW9u"
    "GAIgASgJEhIKCmV4dGVuc2lvbnMYAyADKAkiNQoUTW9kZWxNZXRhZGF0YVJlcXVlc3QSDAoEbmFtZRgBIAEo"
    "CRIPCgd2ZXJzaW9uGAIgASgJIo0CChVNb2RlbE1ldGFkYXRhUmVzcG9uc2USDAoEbmFtZRgBIAEoCRIQCgh2"
    "ZXJzaW9ucxgCIAMoCRIQCghwbGF0Zm9ybRgDIAEoCRI/CgZpbnB1dHMYBCADKAsyLy5pbmZlcmVuY2UuTW9k"
    "ZWxNZXRhZGF0YVJlc3BvbnNlLlRlbnNvck1ldGFkYXRhEkAKB291dHB1dHMYBSADKAsyLy5pbmZlcmVuY2Uu"
    "TW9kZWxNZXRhZGF0YVJlc3BvbnNlLlRlbnNvck1ldGFkYXRhGj8KDlRlbnNvck1ldGFkYXRhEgwKBG5hbWUY"
    "ASABKAkSEAoIZGF0YXR5cGUYAiABKAkSDQoFc2hhcGUYAyADKAMiaQoOSW5mZXJQYXJhbWV0ZXISFAoKYm9v"
    "bF9wYXJhbRgBIAEoCEgAEhUKC2ludDY0X3BhcmFtGAIgASgDSAASFgoMc3RyaW5nX3BhcmFtGAMgASgJSABC"
    "EgoQcGFyYW1ldGVyX2Nob2ljZSLQAQoTSW5mZXJUZW5zb3JDb250ZW50cxIVCg1ib29sX2NvbnRlbnRzGAEg"
    "AygIEhQKDGludF9jb250ZW50cxgCIAMoBRIWCg5pbnQ2NF9jb250ZW50cxgDIAMoAxIVCg11aW50X2NvbnRl"
    "bnRzGAQgAygNEhcKD3VpbnQ2NF9jb250ZW50cxgFIAMoBBIVCg1mcDMyX2NvbnRlbnRzGAYgAygCEhUKDWZw"
    "NjRfY29udGVudHMYByADKAESFgoOYnl0ZXNfY29udGVudHMYCCADKAwi7gYKEU1vZGVsSW5mZXJSZXF1ZXN0"
    "EhIKCm1vZGVsX25hbWUYASABKAkSFQoNbW9kZWxfdmVyc2lvbhgCIAEoCRIKCgJpZBgDIAEoCRJACgpwYXJh"
    "bWV0ZXJzGAQgAygLMiwuaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXF1ZXN0LlBhcmFtZXRlcnNFbnRyeRI9CgZp"
    "bnB1dHMYBSADKAsyLS5pbmZlcmVuY2UuTW9kZWxJbmZlclJlcXVlc3QuSW5mZXJJbnB1dFRlbnNvchJICgdv"
    "dXRwdXRzGAYgAygLMjcuaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXF1ZXN0LkluZmVyUmVxdWVzdGVkT3V0cHV0"
    "VGVuc29yEhoKEnJhd19pbnB1dF9jb250ZW50cxgHIAMoDBqUAgoQSW5mZXJJbnB1dFRlbnNvchIMCgRuYW1l"
    "GAEgASgJEhAKCGRhdGF0eXBlGAIgASgJEg0KBXNoYXBlGAMgAygDElEKCnBhcmFtZXRlcnMYBCADKAsyPS5p"
    "bmZlcmVuY2UuTW9kZWxJbmZlclJlcXVlc3QuSW5mZXJJbnB1dFRlbnNvci5QYXJhbWV0ZXJzRW50cnkSMAoI"
    "Y29udGVudHMYBSABKAsyHi5pbmZlcmVuY2UuSW5mZXJUZW5zb3JDb250ZW50cxpMCg9QYXJhbWV0ZXJzRW50"
    "cnkSCwoDa2V5GAEgASgJEigKBXZhbHVlGAIgASgLMhkuaW5mZXJlbmNlLkluZmVyUGFyYW1ldGVyOgI4ARrV"
    "AQoaSW5mZXJSZXF1ZXN0ZWRPdXRwdXRUZW5zb3ISDAoEbmFtZRgBIAEoCRJbCgpwYXJhbWV0ZXJzGAIgAygL"
    "MkcuaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXF1ZXN0LkluZmVyUmVxdWVzdGVkT3V0cHV0VGVuc29yLlBhcmFt"
    "ZXRlcnNFbnRyeRpMCg9QYXJhbWV0ZXJzRW50cnkSCwoDa2V5GAEgASgJEigKBXZhbHVlGAIgASgLMhkuaW5m"
    "ZXJlbmNlLkluZmVyUGFyYW1ldGVyOgI4ARpMCg9QYXJhbWV0ZXJzRW50cnkSCwoDa2V5GAEgASgJEigKBXZh"
    "bHVlGAIgASgLMhkuaW5mZXJlbmNlLkluZmVyUGFyYW1ldGVyOgI4ASLVBAoSTW9kZWxJbmZlclJlc3BvbnNl"
    "EhIKCm1vZGVsX25hbWUYASABKAkSFQoNbW9kZWxfdmVyc2lvbhgCIAEoCRIKCgJpZBgDIAEoCRJBCgpwYXJh"
    "bWV0ZXJzGAQgAygLMi0uaW5mZXJlbmNlLk1vZGVsSW5mZXJSZXNwb25zZS5QYXJhbWV0ZXJzRW50cnkSQAoH"
    "b3V0cHV0cxgFIAMoCzIvLmluZmVyZW5jZS5Nb2RlbEluZmVyUmVzcG9uc2UuSW5mZXJPdXRwdXRUZW5zb3IS"
    "GwoTcmF3X291dHB1dF9jb250ZW50cxgGIAMoDBqXAgoRSW5mZXJPdXRwdXRUZW5zb3ISDAoEbmFtZRgBIAEo"
    "CRIQCghkYXRhdHlwZRgCIAEoCRINCgVzaGFwZRgDIAMoAxJTCgpwYXJhbWV0ZXJzGAQgAygLMj8uaW5mZXJl"
    "bmNlLk1vZGVsSW5mZXJSZXNwb25zZS5JbmZlck91dHB1dFRlbnNvci5QYXJhbWV0ZXJzRW50cnkSMAoIY29u"
    "dGVudHMYBSABKAsyHi5pbmZlcmVuY2UuSW5mZXJUZW5zb3JDb250ZW50cxpMCg9QYXJhbWV0ZXJzRW50cnkS"
    "CwoDa2V5GAEgASgJEigKBXZhbHVlGAIgASgLMhkuaW5mZXJlbmNlLkluZmVyUGFyYW1ldGVyOgI4ARpMCg9Q"
    "YXJhbWV0ZXJzRW50cnkSCwoDa2V5GAEgASgJEigKBXZhbHVlGAIgASgLMhkuaW5mZXJlbmNlLkluZmVyUGFy"
    "YW1ldGVyOgI4ATL8AwoUR1JQQ0luZmVyZW5jZVNlcnZpY2USSwoKU2VydmVyTGl2ZRIcLmluZmVyZW5jZS5T"
    "ZXJ2ZXJMaXZlUmVxdWVzdBodLmluZmVyZW5jZS5TZXJ2ZXJMaXZlUmVzcG9uc2UiABJOCgtTZXJ2ZXJSZWFk"
    "eRIdLmluZmVyZW5jZS5TZXJ2ZXJSZWFkeVJlcXVlc3QaHi5pbmZlcmVuY2UuU2VydmVyUmVhZHlSZXNwb25z"
    "ZSIAEksKCk1vZGVsUmVhZHkSHC5pbmZlcmVuY2UuTW9kZWxSZWFkeVJlcXVlc3QaHS5pbmZlcmVuY2UuTW9k"
    "ZWxSZWFkeVJlc3BvbnNlIgASVwoOU2VydmVyTWV0YWRhdGESIC5pbmZlcmVuY2UuU2VydmVyTWV0YWRhdGFS"
    "ZXF1ZXN0GiEuaW5mZXJlbmNlLlNlcnZlck1ldGFkYXRhUmVzcG9uc2UiABJUCg1Nb2RlbE1ldGFkYXRhEh8u"
    "aW5mZXJlbmNlLk1vZGVsTWV0YWRhdGFSZXF1ZXN0GiAuaW5mZXJlbmNlLk1vZGVsTWV0YWRhdGFSZXNwb25z"
    "ZSIAEksKCk1vZGVsSW5mZXISHC5pbmZlcmVuY2UuTW9kZWxJbmZlclJlcXVlc3QaHS5pbmZlcmVuY2UuTW9k"
    "ZWxJbmZlclJlc3BvbnNlIgBiBnByb3RvMw=="
)
_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(_DESCRIPTOR)
SERVICE = "inference.GRPCInferenceService"


def message(name: str) -> type:
    """The message class `inference.<name>` (e.g. "ModelInferRequest")."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"inference.{name}"))
