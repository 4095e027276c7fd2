"""The write gate service (``causalmem writes``): proposed memories judged by reward-prediction error."""
