"""SageMaker AI's training-session API over Treadle's platform: the control plane, Hub and model
registry (`sagemaker` json 1.1, `POST /` with X-Amz-Target) and the runtime (rest-json,
`/v1/training-sessions/...`), every request signed with SigV4 by an access key pair that is a
Treadle API key. The official `sagemaker-train` SDK and boto3 run against it unmodified
(docs/sagemaker.md). Imports platform only; never torch.
"""
