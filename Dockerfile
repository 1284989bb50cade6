# One image for every service; docker-compose.yml picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gen ./gen
COPY services ./services
COPY examples ./examples
RUN pip install --no-cache-dir .
ENV MJ_DATA_DIR=/data \
    MJ_HOST=0.0.0.0
VOLUME /data
