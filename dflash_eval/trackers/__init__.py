"""The tau table where trainers look: TensorBoard, W&B and MLflow."""
