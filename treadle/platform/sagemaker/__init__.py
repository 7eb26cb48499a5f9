"""SageMaker AI's training-session resources over the platform: ARNs and account ids (`arns`),
the Public Hub of base models (`hub`), named training sessions and their statuses
(`training_sessions`), the model registry over checkpoints (`packages`) and the runtime's
operations (`runtime_ops`). The wire protocols are the API's (treadle/api/sagemaker).
Imports nothing from api, engine, worker, flask or torch.
"""
